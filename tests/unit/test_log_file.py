"""The daemon's log file (natsfs/cli.py `PrivateLogFile`): reopened when moved or deleted, and a reopen
the path refuses (its directory removed, a symlink put there) never raises out of a logging call (in the
FUSE thread that would end the daemon): the lines go on to the old file, and it says so once."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from natsfs.cli import PrivateLogFile


@pytest.fixture()
def logger(tmp_path: Path) -> Iterator[tuple[logging.Logger, PrivateLogFile]]:
    (tmp_path / "logs").mkdir()
    handler = PrivateLogFile(tmp_path / "logs" / "x.log")
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log = logging.getLogger(f"natsfs-test-log-{tmp_path.name}")
    log.propagate = False
    log.addHandler(handler)
    yield log, handler
    log.removeHandler(handler)
    handler.close()


def test_log_directory_removed_keeps_logging_and_reopens_when_it_is_back(logger, tmp_path):
    log, _ = logger
    log.warning("before")
    with open(tmp_path / "logs" / "x.log", "rb") as old:  # the file the handler writes to, kept by this fd
        shutil.rmtree(tmp_path / "logs")
        log.warning("while the directory is gone")  # (raised FileNotFoundError out of the logging call)
        log.warning("still gone")
        lines = old.read().decode().splitlines()
    assert lines[0] == "WARNING before"
    assert lines[1].startswith(f"WARNING cannot reopen the log file {tmp_path / 'logs' / 'x.log'} "
                               "(No such file or directory)")
    assert lines[2:] == ["WARNING while the directory is gone", "WARNING still gone"]  # said once
    (tmp_path / "logs").mkdir()
    log.warning("back")
    new = (tmp_path / "logs" / "x.log").read_text().splitlines()
    assert new[0].startswith("WARNING reopened the log file") and "No such file or directory" in new[0]
    assert new[1:] == ["WARNING back"]
    assert (tmp_path / "logs" / "x.log").stat().st_mode & 0o777 == 0o600


def test_symlink_put_at_the_log_path_is_never_followed(logger, tmp_path):
    log, _ = logger
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    log.warning("before")
    os.rename(tmp_path / "logs" / "x.log", tmp_path / "logs" / "x.log.1")  # logrotate moved it
    (tmp_path / "logs" / "x.log").symlink_to(victim)
    log.warning("while a symlink is there")
    assert victim.read_text() == "keep\n"
    rotated = (tmp_path / "logs" / "x.log.1").read_text().splitlines()
    assert "it is a symlink" in rotated[1] and rotated[2] == "WARNING while a symlink is there"
    (tmp_path / "logs" / "x.log").unlink()
    log.warning("after")
    assert (tmp_path / "logs" / "x.log").read_text().splitlines()[1:] == ["WARNING after"]
