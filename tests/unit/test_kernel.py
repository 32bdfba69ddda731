"""kernel.KernelNotifier and its child (natsfs.notifier), with a pipe standing in for /dev/fuse: the
messages the kernel would get, one per change, none while a request on the inode is in flight."""

from __future__ import annotations

import contextlib
import os
import struct
from pathlib import Path

import pytest
import trio

from natsfs.kernel import FUSE_NOTIFY_INVAL_ENTRY, FUSE_NOTIFY_INVAL_INODE, KernelNotifier, notify_message


def _parse(data: bytes) -> list[tuple[int, bytes]]:
    """Split what was written to the device into (notify code, body) per message."""
    out = []
    while data:
        length, code, unique = struct.unpack("=IiQ", data[:16])
        assert unique == 0
        out.append((code, data[16:length]))
        data = data[length:]
    return out


def test_the_messages_are_the_kernels_layout():
    entry = notify_message(("entry", 7, b"name.txt"))
    assert entry == struct.pack("=IiQ", 16 + 16 + 9, FUSE_NOTIFY_INVAL_ENTRY, 0) + struct.pack("=QII", 7, 8, 0) \
        + b"name.txt\0"
    assert notify_message(("attr", 9, None)) == struct.pack("=IiQQqq", 40, FUSE_NOTIFY_INVAL_INODE, 0, 9, -1, 0)
    assert notify_message(("inode", 9, None)) == struct.pack("=IiQQqq", 40, FUSE_NOTIFY_INVAL_INODE, 0, 9, 0, 0)


def test_the_child_writes_each_change_once_and_waits_for_requests_in_flight():
    busy: set[int] = set()
    read_end, device = os.pipe()

    async def main() -> bytes:
        notifier = KernelNotifier(busy=busy.__contains__)
        async with trio.open_nursery() as nursery:
            notifier.start(nursery)
            notifier.attach(device)
            busy.add(1)
            notifier.entry(1, b"a")  # its directory has a request in flight: held back
            notifier.inode(2)
            notifier.inode(2)  # the same change twice: one message
            notifier.inode(1, attr_only=True)  # attributes take no lock: never held back
            with trio.fail_after(10):
                while notifier.done < 2:
                    await trio.sleep(0.01)
            busy.discard(1)
            notifier.idle(1)
            with trio.fail_after(10):
                while notifier.done < 3:
                    await trio.sleep(0.01)
            await notifier.close()
            nursery.cancel_scope.cancel()
        return os.read(read_end, 4096)

    try:
        written = trio.run(main)
    finally:
        os.close(read_end)
    assert _parse(written) == [
        (FUSE_NOTIFY_INVAL_INODE, struct.pack("=Qqq", 2, 0, 0)),
        (FUSE_NOTIFY_INVAL_INODE, struct.pack("=Qqq", 1, -1, 0)),
        (FUSE_NOTIFY_INVAL_ENTRY, struct.pack("=QII", 1, 1, 0) + b"a\0"),
    ]


def test_a_dead_child_is_reaped_and_replaced_and_what_it_had_not_answered_is_sent_again():
    """The first child's device is a pipe nobody reads, filled up: its write blocks, so what it was
    handed stays unanswered. Killed, it is reaped (no zombie) and the next child, on a new device,
    writes those invalidations and the ones asked meanwhile."""
    import signal

    from natsfs.retry import Restarts

    stuck_read, stuck = os.pipe()
    os.set_blocking(stuck, False)
    try:
        while True:
            os.write(stuck, b"x" * 65536)
    except BlockingIOError:
        pass
    os.set_blocking(stuck, True)
    read_end, device = os.pipe()
    reopened = []

    def reopen() -> int:
        reopened.append(True)
        return os.dup(device)

    class AskWhileNoChildRuns(Restarts):
        def died(self) -> float:
            assert notifier.degraded and not notifier.running
            notifier.entry(1, b"meanwhile")  # asked while no child runs: queued, not dropped
            return super().died()

    notifier = KernelNotifier(restarts=AskWhileNoChildRuns(first=0.01))

    async def main() -> tuple[int, int | None, bool]:
        async with trio.open_nursery() as nursery:
            notifier.start(nursery)
            notifier.attach(stuck, reopen=reopen)
            first = notifier.pid
            assert first is not None
            notifier.inode(5)  # handed to the first child, which blocks writing it
            with trio.fail_after(10):
                while len(notifier._unanswered_items) != 1 or notifier._queue:
                    await trio.sleep(0.01)
            os.kill(first, signal.SIGKILL)
            with trio.fail_after(10):
                while notifier.done < 2:
                    await trio.sleep(0.01)
            second = notifier.pid
            stat = Path(f"/proc/{first}/stat")
            zombie = stat.exists() and stat.read_text().rsplit(") ", 1)[1][0] == "Z"
            await notifier.close()
            nursery.cancel_scope.cancel()
        return first, second, zombie

    try:
        first, second, zombie = trio.run(main)
        written = os.read(read_end, 4096)
    finally:
        for fd in (stuck_read, read_end, device):
            os.close(fd)
    assert second != first and not zombie and reopened == [True]
    assert _parse(written) == [
        (FUSE_NOTIFY_INVAL_INODE, struct.pack("=Qqq", 5, 0, 0)),
        (FUSE_NOTIFY_INVAL_ENTRY, struct.pack("=QII", 1, 9, 0) + b"meanwhile\0"),
    ]


@pytest.mark.expect_log("kernel notifier failed 2 times in a row")
def test_a_child_that_runs_again_after_failed_restarts_is_said_at_warning_when_it_dies(caplog):
    """Restarts that failed in a row are said once at ERROR, and their deaths only at DEBUG. Once a child
    ran long enough again, its death is an ordinary one: one WARNING (it was said at DEBUG, as if the
    streak of failures still went on)."""
    import logging
    import signal

    from natsfs.retry import Restarts

    caplog.set_level(logging.DEBUG, logger="natsfs")
    read_end, device = os.pipe()
    now = [100.0]
    refusals = [2]  # the first two new devices cannot be opened

    def reopen() -> int:
        if refusals[0]:
            refusals[0] -= 1
            raise OSError(24, "Too many open files")
        return os.dup(device)

    notifier = KernelNotifier(restarts=Restarts(first=0.01, cap=0.02, stable=10, give_up_after=2,
                                                clock=lambda: now[0]))

    async def wait_for_a_child_other_than(pid: int | None) -> int:
        with trio.fail_after(10):
            while notifier.pid == pid or not notifier.running:
                await trio.sleep(0.01)
        assert notifier.pid is not None
        return notifier.pid

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            notifier.start(nursery)
            notifier.attach(os.dup(device), reopen=reopen)
            first = notifier.pid
            assert first is not None
            os.kill(first, signal.SIGKILL)  # dies at once; then two starts fail: said at ERROR
            second = await wait_for_a_child_other_than(first)
            assert notifier.restarts.failing
            now[0] += 60  # it runs a minute
            os.kill(second, signal.SIGKILL)
            await wait_for_a_child_other_than(second)
            await notifier.close()
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        os.close(read_end)
        os.close(device)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "died" in r.getMessage()
            or "failed" in r.getMessage()]
    assert [level for level, _ in said] == [logging.WARNING, logging.ERROR, logging.WARNING], said


def _full_pipe() -> tuple[int, int]:
    """A pipe nobody reads, filled up: a child writing to it blocks in the system call."""
    stuck_read, stuck = os.pipe()
    os.set_blocking(stuck, False)
    try:
        while True:
            os.write(stuck, b"x" * 65536)
    except BlockingIOError:
        pass
    os.set_blocking(stuck, True)
    return stuck_read, stuck


def test_a_child_stuck_in_a_write_is_killed_and_replaced_and_the_kernel_gets_short_timeouts_meanwhile(caplog):
    """The first child blocks writing to its device and never answers. Once its answer is overdue by
    more than DEGRADED_TIMEOUT the notifier counts as degraded (the kernel gets 1 s timeouts) although the
    child still runs; after `hung_after` with no answer it is killed, reaped, said once at WARNING as not
    answering, and the next child writes the invalidation it had not answered."""
    import logging

    from natsfs.kernel import DEGRADED_TIMEOUT
    from natsfs.retry import Restarts

    caplog.set_level(logging.DEBUG, logger="natsfs")
    stuck_read, stuck = _full_pipe()
    read_end, device = os.pipe()
    notifier = KernelNotifier(restarts=Restarts(first=0.01), hung_after=DEGRADED_TIMEOUT + 1.5)

    async def main() -> tuple[int, int | None, bool]:
        async with trio.open_nursery() as nursery:
            notifier.start(nursery)
            notifier.attach(stuck, reopen=lambda: os.dup(device))
            first = notifier.pid
            assert first is not None and not notifier.degraded
            notifier.inode(5)  # handed to the first child, which blocks writing it
            with trio.fail_after(10):
                while not notifier.degraded:
                    await trio.sleep(0.01)
            degraded_while_running = notifier.running and notifier.pid == first
            with trio.fail_after(20):
                while notifier.done < 1:
                    await trio.sleep(0.01)
            assert not notifier.degraded
            second = notifier.pid
            await notifier.close()
            nursery.cancel_scope.cancel()
        return first, second, degraded_while_running

    try:
        first, second, degraded_while_running = trio.run(main)
        written = os.read(read_end, 4096)
    finally:
        for fd in (stuck_read, read_end, device):
            os.close(fd)
    assert degraded_while_running and second != first
    assert _parse(written) == [(FUSE_NOTIFY_INVAL_INODE, struct.pack("=Qqq", 5, 0, 0))]
    stat = Path(f"/proc/{first}/stat")
    assert not stat.exists() or stat.read_text().rsplit(") ", 1)[1][0] != "Z"  # reaped
    said = [(r.levelno, r.getMessage()) for r in caplog.records if f"(pid {first})" in r.getMessage()
            and r.levelno >= logging.WARNING]
    assert len(said) == 1 and "did not answer" in said[0][1] and "killed it" in said[0][1], said


def test_a_stopped_child_is_killed_and_replaced_and_a_child_that_answers_is_left_alone():
    """SIGSTOP: the child exists but answers nothing. Answered invalidations never make a child hung,
    however long it runs idle between them."""
    import signal

    from natsfs.retry import Restarts

    read_end, device = os.pipe()
    # (A limit long enough that a loaded machine's scheduling never makes an answer that late.)
    notifier = KernelNotifier(restarts=Restarts(first=0.01), hung_after=2.0)

    async def main() -> tuple[int, int | None, int | None]:
        async with trio.open_nursery() as nursery:
            notifier.start(nursery)
            notifier.attach(os.dup(device), reopen=lambda: os.dup(device))
            first = notifier.pid
            assert first is not None
            notifier.inode(1)
            with trio.fail_after(10):
                while notifier.done < 1:
                    await trio.sleep(0.01)
            await trio.sleep(2.5)  # idle, longer than hung_after: nothing waits, so not hung
            still = notifier.pid
            os.kill(first, signal.SIGSTOP)
            try:
                notifier.inode(2)
                with trio.fail_after(20):
                    while notifier.done < 2:
                        await trio.sleep(0.01)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(first, signal.SIGCONT)
            second = notifier.pid
            await notifier.close()
            nursery.cancel_scope.cancel()
        return first, still, second

    try:
        first, still, second = trio.run(main)
        written = os.read(read_end, 4096)
    finally:
        os.close(read_end)
        os.close(device)
    assert still == first and second != first
    assert _parse(written) == [(FUSE_NOTIFY_INVAL_INODE, struct.pack("=Qqq", 1, 0, 0)),
                               (FUSE_NOTIFY_INVAL_INODE, struct.pack("=Qqq", 2, 0, 0))]


def test_invalidations_queued_while_no_child_runs_are_capped_oldest_first(caplog):
    """While restarts keep failing, other clients' changes keep asking for invalidations: the queue keeps
    the newest `queue_cap` of them, and says once at WARNING that it drops the oldest."""
    import logging
    import signal

    from natsfs.retry import Restarts

    caplog.set_level(logging.DEBUG, logger="natsfs")
    read_end, device = os.pipe()

    def reopen() -> int:
        raise OSError(24, "Too many open files")

    notifier = KernelNotifier(restarts=Restarts(first=0.01, cap=0.02, stable=10, give_up_after=2), queue_cap=4)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            notifier.start(nursery)
            notifier.attach(os.dup(device), reopen=reopen)
            pid = notifier.pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            with trio.fail_after(10):
                while notifier.running:
                    await trio.sleep(0.01)
            for ino in range(10, 20):
                notifier.inode(ino)
            assert notifier.queued == [("inode", ino, None) for ino in range(16, 20)]
            assert notifier.dropped == 6
            await notifier.close()
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        os.close(read_end)
        os.close(device)
    said = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(said) == 1 and "4 invalidations wait" in said[0], said


def test_attrs_dropped_returns_once_the_kernel_answered_and_a_stuck_child_costs_only_the_bound():
    """A refused close waits for the kernel to drop the inode's attributes before it returns: the wait
    ends with the child's answer (the message was written); a child that does not answer holds it at
    most `within` seconds (the wait gives up, the invalidation still unanswered, long before the child
    would be killed as hung); with no kernel attached it does not wait."""
    read_end, device = os.pipe()
    stuck_read, stuck = _full_pipe()

    async def main() -> tuple[list[bool], int, int, bool]:
        notifier = KernelNotifier()
        outcomes = [await notifier.attrs_dropped(7, within=30)]  # not attached: nothing to wait for
        async with trio.open_nursery() as nursery:
            notifier.start(nursery)
            notifier.attach(device)
            with trio.fail_after(10):
                outcomes.append(await notifier.attrs_dropped(7, within=30))
            answered = notifier.done
            await notifier.close()
            # hung_after far above both `within` and the guard: only the bound can end the wait.
            stuck_notifier = KernelNotifier(hung_after=600)
            stuck_notifier.start(nursery)
            stuck_notifier.attach(stuck)
            child = stuck_notifier.pid
            with trio.fail_after(60):  # (a guard only: the bound is 0.5 s)
                outcomes.append(await stuck_notifier.attrs_dropped(8, within=0.5))
            stuck_answered = stuck_notifier.done
            same_child = child is not None and stuck_notifier.pid == child  # not killed, not replaced
            await stuck_notifier.close()
            nursery.cancel_scope.cancel()
        return outcomes, answered, stuck_answered, same_child

    try:
        outcomes, answered, stuck_answered, same_child = trio.run(main)
        written = os.read(read_end, 4096)
    finally:
        for fd in (stuck_read, read_end, device):
            with contextlib.suppress(OSError):
                os.close(fd)
    assert answered == 1
    assert _parse(written) == [(FUSE_NOTIFY_INVAL_INODE, struct.pack("=Qqq", 7, -1, 0))]
    # Not attached: True at once; answered: True; stuck: the wait gave up at `within` (False), unanswered.
    assert outcomes == [True, True, False]
    assert stuck_answered == 0 and same_child
