"""uploader.UploadWorker's supervision: a dead worker is reaped, said at WARNING and started again;
restarts that fail in a row are said once at ERROR. A stand-in process takes the worker's place (it
reads its stdin until closed): only the daemon's side is under test here."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from natsfs import uploader
from natsfs.auth import Connection
from natsfs.errors import NatsFSError, NoSpace, Unavailable
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


# A stand-in worker that answers pings at once and holds every other request until it has answered
# `hold_for` pings since (then answers it); with `hold_for` < 0 it answers nothing at all (hung).
_STAND_IN = r"""
import json, sys
hold_for = int(sys.argv[1])
held = []
sys.stdin.readline()  # the connection
while line := sys.stdin.readline():
    req = json.loads(line)
    if hold_for < 0:
        continue
    if req["op"] == "ping":
        print(json.dumps({"id": req["id"]}), flush=True)
        held = [[rid, left - 1] for rid, left in held]
        for rid, left in held:
            if left <= 0:
                print(json.dumps({"id": rid, "chunks": 1}), flush=True)
        held = [h for h in held if h[1] > 0]
    else:
        held.append([req["id"], hold_for])
"""


def _stand_in_workers(monkeypatch: pytest.MonkeyPatch, hold_for: list[int]) -> None:
    """Each worker started is the stand-in with the next of `hold_for` (the last one repeats)."""
    real_open_process = trio.lowlevel.open_process

    async def stand_in(argv: list[str], **kwargs: Any) -> trio.Process:
        this = hold_for.pop(0) if len(hold_for) > 1 else hold_for[0]
        return await real_open_process([sys.executable, "-c", _STAND_IN, str(this)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    monkeypatch.setattr(uploader.trio.lowlevel, "open_process", stand_in)


def test_a_worker_that_answers_nothing_is_killed_replaced_and_said_once_as_not_answering(monkeypatch, caplog):
    """Stopped or stuck: the request waiting for it fails with Unavailable (the caller publishes in-process)
    once nothing came back for `hung_after` s; the worker is killed and reaped and a new one started; one
    WARNING says it did not answer."""
    caplog.set_level(logging.DEBUG, logger="natsfs")
    _stand_in_workers(monkeypatch, [-1, 0])
    worker = uploader.UploadWorker(Connection(servers=("nats://127.0.0.1:1",)), Restarts(first=0.01),
                                   hung_after=0.5, ping_every=0.1)

    async def main() -> tuple[int, int]:
        async with trio.open_nursery() as nursery:
            await worker.start(nursery)
            first = worker.pid
            assert first is not None
            with trio.fail_after(20), pytest.raises(uploader.Unavailable):
                await worker.send_range("S", "$O.b.C.S", "/dev/null", 0, 1, 1, 1)
            with trio.fail_after(10):
                while worker.pid == first or not worker.alive:
                    await trio.sleep(0.01)
            second = worker.pid
            assert second is not None
            await worker.send_range("T", "$O.b.C.T", "/dev/null", 0, 1, 1, 1)  # the new one answers
            await worker.close()
            nursery.cancel_scope.cancel()
        return first, second

    first, second = trio.run(main)
    assert second != first and not Path(f"/proc/{first}").exists()  # reaped
    said = [r.getMessage() for r in caplog.records if f"(pid {first})" in r.getMessage()
            and r.levelno >= logging.WARNING]
    assert len(said) == 1 and "did not answer" in said[0] and "killed it" in said[0], said


def test_a_busy_worker_that_answers_pings_is_not_killed_however_long_its_request_takes(monkeypatch, caplog):
    """A large range legitimately takes longer than `hung_after`: the worker's event loop answers pings
    meanwhile, so it is not hung."""
    # The send is answered only after the stand-in answered 50 pings, which the daemon sends one per
    # `ping_every` while the send waits: the send outlasts `hung_after` many times over by construction
    # (the pings, not a clock, say so). `hung_after` is long enough that a loaded machine's scheduling
    # never makes one ping's answer that late.
    hold_for = 50
    _stand_in_workers(monkeypatch, [hold_for])
    worker = uploader.UploadWorker(Connection(servers=("nats://127.0.0.1:1",)), Restarts(first=0.01),
                                   hung_after=3.0, ping_every=0.1)
    assert (hold_for - 2) * worker.ping_every > worker.hung_after
    pings_answered = [0]
    real_request = worker._request

    async def counting_request(child: Any, body: dict[str, Any]) -> dict[str, Any]:
        reply = await real_request(child, body)
        if body["op"] == "ping":
            pings_answered[0] += 1
        return reply

    monkeypatch.setattr(worker, "_request", counting_request)

    async def main() -> tuple[int, int | None, int]:
        async with trio.open_nursery() as nursery:
            await worker.start(nursery)
            first = worker.pid
            assert first is not None
            with trio.fail_after(60):
                await worker.send_range("S", "$O.b.C.S", "/dev/null", 0, 1, 1, 1)
            pings = pings_answered[0]
            pid = worker.pid
            await worker.close()
            nursery.cancel_scope.cancel()
        return first, pid, pings

    first, pid, pings = trio.run(main)
    # The same worker answered the send, after answering the pings the long send gave rise to (the last
    # ping's answer and the send's arrive together: either may be taken first).
    assert pid == first and pings >= hold_for - 1
    assert "did not answer" not in caplog.text


def test_a_drop_the_worker_does_not_answer_is_not_taken_for_done_until_that_worker_is_reaped(monkeypatch):
    """The daemon purges a put it gave up only once the worker says it sends nothing more of it. A worker
    that never answers says nothing: `drop` is False (the put is not settled), and True only once that
    worker process is gone (killed as hung, reaped, replaced), without asking the new one."""
    _stand_in_workers(monkeypatch, [-1, 0])
    worker = uploader.UploadWorker(Connection(servers=("nats://127.0.0.1:1",)), Restarts(first=0.01),
                                   hung_after=3.0, ping_every=0.1)  # (long: the drops below come first)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await worker.start(nursery)
            first = worker.pid

            async def send() -> None:
                with pytest.raises(uploader.Unavailable):
                    await worker.send_range("S", "$O.b.C.S", "/dev/null", 0, 1, 1, 1)

            nursery.start_soon(send)
            with trio.fail_after(10):
                while "S" not in worker._sessions:
                    await trio.sleep(0.01)
            with trio.move_on_after(0.1) as waited:
                await worker.drop("S")
            assert waited.cancelled_caught  # (no answer: its caller's deadline passes)
            with trio.fail_after(20):
                assert await worker.drop("S") is False  # it never answered: it was killed meanwhile
                while worker.pid == first or not worker.alive:
                    await trio.sleep(0.01)
            assert await worker.drop("S") is True  # that process is reaped: nothing more of S is sent
            assert "S" not in worker._sessions
            await worker.close()
            nursery.cancel_scope.cancel()

    trio.run(main)


# A stand-in worker whose every send is answered with the error reply given as its argument (JSON).
_REFUSING_STAND_IN = r"""
import json, sys
error = json.loads(sys.argv[1])
sys.stdin.readline()  # the connection
while line := sys.stdin.readline():
    req = json.loads(line)
    reply = {"id": req["id"]} if req["op"] == "ping" else {"id": req["id"], "error": error}
    print(json.dumps(reply), flush=True)
"""


@pytest.mark.parametrize(("error", "raised"), [
    # The bucket's limits (nats-server answers these with code 503): refused for good, never sent again.
    ({"description": "maximum bytes exceeded", "code": 503, "err_code": 10077}, NoSpace),
    ({"description": "maximum messages exceeded", "code": 503, "err_code": 10077}, NoSpace),
    # No responders, or a JetStream between leaders: sent again in-process.
    ({"description": "no stream takes $O.b.C.S", "code": 503, "err_code": 0}, Unavailable),
    ({"description": "JetStream cluster not available", "code": 503, "err_code": 10008}, Unavailable),
])
def test_a_refusal_by_the_buckets_limits_that_comes_with_code_503_is_not_taken_for_an_unavailable_worker(
        monkeypatch, error, raised):
    """A worker's publish refused for the bucket's max_bytes made the put send the whole file again
    in-process (after an INFO line `the upload worker could not send it`), only to be refused again."""
    real_open_process = trio.lowlevel.open_process

    async def stand_in(argv: list[str], **kwargs: Any) -> trio.Process:
        return await real_open_process([sys.executable, "-c", _REFUSING_STAND_IN, json.dumps(error)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    monkeypatch.setattr(uploader.trio.lowlevel, "open_process", stand_in)
    worker = uploader.UploadWorker(Connection(servers=("nats://127.0.0.1:1",)), Restarts(first=0.01))

    async def main() -> BaseException:
        async with trio.open_nursery() as nursery:
            await worker.start(nursery)
            with trio.fail_after(20), pytest.raises(NatsFSError) as caught:
                await worker.send_range("S", "$O.b.C.S", "/dev/null", 0, 1, 1, 1)
            await worker.close()
            nursery.cancel_scope.cancel()
        return caught.value

    got = trio.run(main)
    assert type(got) is raised, got
    if raised is NoSpace:
        assert got.errno == errno.ENOSPC and "maximum" in str(got)


def test_a_worker_that_finds_no_server_exits_saying_so():
    """Its exit status tells the daemon the server is away, not that it died."""
    from natsfs.bridge import WORKER_FOUND_NO_SERVER

    proc = subprocess.run([sys.executable, "-I", "-m", "natsfs.bridge", "upload-worker"], capture_output=True,
                          input=Connection(servers=("nats://127.0.0.1:1",)).to_json().encode() + b"\n",
                          timeout=60)
    assert proc.returncode == WORKER_FOUND_NO_SERVER, proc.stderr


def test_workers_started_while_no_server_answers_are_not_said_as_deaths_or_failures(monkeypatch, caplog):
    """A server away (or refusing the credentials) while a worker starts: the daemon's connection says
    that once; each worker start meanwhile ended with a WARNING `died (exit status 1)` and, after five, an
    ERROR `failed 5 times in a row`. They are started again (with growing pauses) and said at DEBUG."""
    from natsfs.bridge import WORKER_FOUND_NO_SERVER

    caplog.set_level(logging.DEBUG, logger="natsfs")
    real_open_process = trio.lowlevel.open_process
    no_server_starts = [7]  # more than give_up_after
    starts = [0]

    async def stand_in(argv: list[str], **kwargs: Any) -> trio.Process:
        starts[0] += 1
        if no_server_starts[0]:
            no_server_starts[0] -= 1
            code = f"import sys; sys.stdin.readline(); sys.exit({WORKER_FOUND_NO_SERVER})"
        else:
            code = "import sys; sys.stdin.read()"
        return await real_open_process([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE)

    monkeypatch.setattr(uploader.trio.lowlevel, "open_process", stand_in)
    worker = uploader.UploadWorker(Connection(servers=("nats://127.0.0.1:1",)),
                                   Restarts(first=0.01, cap=0.02, stable=10, give_up_after=5))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await worker.start(nursery)
            with trio.fail_after(30):
                while starts[0] < 8 or not worker.alive:  # the eighth runs
                    await trio.sleep(0.01)
            assert not worker.restarts.failing
            await worker.close()
            nursery.cancel_scope.cancel()

    trio.run(main)
    about_workers = [r for r in caplog.records if "upload worker" in r.getMessage()]
    assert [r.levelno for r in about_workers if r.levelno >= logging.INFO] == [], \
        [r.getMessage() for r in about_workers]
    assert sum("found no NATS server" in r.getMessage() for r in about_workers) == 7
