"""The daemon's filter for pyfuse3's "fuse_reply_* failed" ERROR: ENOENT (the kernel no longer waits for
the reply, see natsfs.cli.UndeliveredReplies) becomes one DEBUG line; every other errno stays an ERROR."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterator

import pytest

from natsfs.cli import UndeliveredReplies


def _record(msg: str, *args: object, level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord("pyfuse3", level, "handlers.pxi", 514, msg, args, None)


@pytest.fixture()
def pyfuse3_level() -> Iterator[logging.Logger]:
    logger = logging.getLogger("pyfuse3")
    saved = logger.level
    yield logger
    logger.setLevel(saved)


def test_enoent_reply_failure_becomes_one_debug_line(pyfuse3_level: logging.Logger) -> None:
    pyfuse3_level.setLevel(logging.DEBUG)
    record = _record("fuse_release(): fuse_reply_* failed with %s", os.strerror(errno.ENOENT))
    assert UndeliveredReplies().filter(record)
    assert (record.levelno, record.levelname) == (logging.DEBUG, "DEBUG")
    assert record.getMessage() == ("fuse_release(): the kernel no longer waits for this reply "
                                   "(No such file or directory: the connection ended meanwhile)")


def test_enoent_reply_failure_is_dropped_below_debug(pyfuse3_level: logging.Logger) -> None:
    pyfuse3_level.setLevel(logging.INFO)
    record = _record("fuse_read(): fuse_reply_* failed with %s", os.strerror(errno.ENOENT))
    assert not UndeliveredReplies().filter(record)


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENODEV, errno.EBADF, errno.EIO])
def test_other_errnos_stay_errors(pyfuse3_level: logging.Logger, code: int) -> None:
    pyfuse3_level.setLevel(logging.DEBUG)
    record = _record("fuse_read(): fuse_reply_* failed with %s", os.strerror(code))
    assert UndeliveredReplies().filter(record)
    assert record.levelno == logging.ERROR
    assert record.getMessage() == f"fuse_read(): fuse_reply_* failed with {os.strerror(code)}"


@pytest.mark.parametrize("msg", ["py_retval was not awaited - please report a bug at %s",
                                 "fuse_setattr(): clock_gettime(CLOCK_REALTIME) failed with %s"])
def test_other_pyfuse3_errors_stay_errors(pyfuse3_level: logging.Logger, msg: str) -> None:
    pyfuse3_level.setLevel(logging.DEBUG)
    record = _record(msg, os.strerror(errno.ENOENT))
    assert UndeliveredReplies().filter(record)
    assert record.levelno == logging.ERROR and record.msg == msg
