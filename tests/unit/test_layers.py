"""The core can be driven without FUSE: importing it (and everything below it) never imports pyfuse3."""

from __future__ import annotations

import subprocess
import sys


def test_the_filesystem_core_does_not_import_pyfuse3():
    probe = ("import sys, natsfs.core.filesystem, natsfs.core.openfiles\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'pyfuse3'))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
