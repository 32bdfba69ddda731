"""uploader.UploadWorker's supervision: a dead worker is reaped, said at WARNING and started again;
restarts that fail in a row are said once at ERROR. A stand-in process takes the worker's place (it
reads its stdin until closed): only the daemon's side is under test here."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from typing import Any

import pytest
import trio

from natsfs import uploader
from natsfs.auth import Connection
from natsfs.retry import Restarts


@pytest.mark.expect_log("upload worker failed 2 times in a row")
def test_a_worker_that_runs_again_after_failed_restarts_is_said_at_warning_when_it_dies(monkeypatch, caplog):
    """Its death was said at DEBUG, as if the streak of failed restarts still went on."""
    caplog.set_level(logging.DEBUG, logger="natsfs")
    now = [100.0]
    refusals = [2]  # the first two restarts cannot start a process
    real_open_process = trio.lowlevel.open_process

    async def stand_in(argv: list[str], **kwargs: Any) -> trio.Process:
        if refusals[0] and worker.generation:
            refusals[0] -= 1
            raise OSError(11, "Resource temporarily unavailable")
        return await real_open_process([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    monkeypatch.setattr(uploader.trio.lowlevel, "open_process", stand_in)
    worker = uploader.UploadWorker(Connection(servers=("nats://127.0.0.1:1",)),
                                   Restarts(first=0.01, cap=0.02, stable=10, give_up_after=2, clock=lambda: now[0]))

    async def a_worker_other_than(pid: int | None) -> int:
        with trio.fail_after(10):
            while worker.pid == pid or not worker.alive:
                await trio.sleep(0.01)
        assert worker.pid is not None
        return worker.pid

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await worker.start(nursery)
            first = await a_worker_other_than(None)
            os.kill(first, signal.SIGKILL)  # dies at once; then two starts fail: said at ERROR
            second = await a_worker_other_than(first)
            assert worker.restarts.failing
            now[0] += 60  # it runs a minute
            os.kill(second, signal.SIGKILL)
            await a_worker_other_than(second)
            await worker.close()
            nursery.cancel_scope.cancel()

    trio.run(main)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "died" in r.getMessage()
            or "failed" in r.getMessage()]
    assert [level for level, _ in said] == [logging.WARNING, logging.ERROR, logging.WARNING], said
