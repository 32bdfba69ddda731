"""A full spool is one warning per interval, whatever the number of writes and truncates it refuses."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest

from natsfs.errors import NoSpace
from natsfs.staging import SPOOL_FULL_WARNING_INTERVAL_S, Spool


def test_refusals_in_a_row_are_one_warning_and_counted_in_the_next(tmp_path: Path, caplog) -> None:
    now = [1000.0]
    spool = Spool(tmp_path, 1 << 20, clock=lambda: now[0])
    spool.charge(0, 5)
    caplog.set_level(logging.DEBUG, logger="natsfs.staging")
    for _ in range(400):  # `truncate -s 1T` (or a write past the limit) retried in a loop
        with pytest.raises(NoSpace) as refused:
            spool.charge(5, 1 << 40)
        assert refused.value.errno == errno.ENOSPC
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"spool is full: 5 of {1 << 20} bytes staged; refusing {(1 << 40) - 5} more"]
    assert spool.used == 5

    caplog.clear()
    now[0] += SPOOL_FULL_WARNING_INTERVAL_S
    with pytest.raises(NoSpace):
        spool.charge(5, 2 << 20)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"spool is full: 5 of {1 << 20} bytes staged; refusing {(2 << 20) - 5} more "
                        "(399 more refused since the last such warning)"]
    spool.charge(5, 1 << 20)  # what fits is still taken
    assert spool.used == 1 << 20
