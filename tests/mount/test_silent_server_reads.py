"""Reads from a server that keeps the connection open but answers nothing (stopped with SIGSTOP, or a
network that drops packets without a reset): once one request has waited a whole request timeout for
the server to say anything, the next ones ask it for a PING's answer and fail at once without it, so
one `read(2)` the kernel sends as several requests waits one deadline, not one each."""

from __future__ import annotations

import errno
import os
import signal

import pytest
from helpers import create_bucket, raw_put, stop_process

CHUNK = 128 * 1024


@pytest.mark.expect_log(r"no answer from the server within|the server has not answered for")
def test_a_read_from_a_silent_server_waits_one_deadline_and_reads_again_once_it_answers(private_server, mounter):
    url = private_server.url
    create_bucket(url, "quiet")
    data = os.urandom(32 * CHUNK)
    raw_put(url, "quiet", "obj", [data[o : o + CHUNK] for o in range(0, len(data), CHUNK)])
    m = mounter(url, "--request-timeout", "2s")
    path = m.path / "quiet" / "obj"
    assert path.stat().st_size == len(data)
    assert private_server.proc is not None
    pid = private_server.proc.pid
    fd = os.open(path, os.O_RDONLY)
    try:
        stop_process(pid)
        try:
            with pytest.raises(OSError) as failed:
                os.pread(fd, 1024 * 1024, 0)
            assert failed.value.errno == errno.EIO
            log = m.log()
            # The first try waited its deadline; every request after it asked the server for a sign of
            # life and failed without a wait of its own.
            assert "the server has not answered for" in log, log[-3000:]
            assert log.count("no answer from the server within") <= 1, log[-3000:]
        finally:
            os.kill(pid, signal.SIGCONT)
        # The server answers again: the same handle reads the right bytes.
        assert os.pread(fd, len(data), 0) == data
        assert os.pread(fd, CHUNK, len(data) - CHUNK) == data[-CHUNK:]
    finally:
        os.close(fd)
