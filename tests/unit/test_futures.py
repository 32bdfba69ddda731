"""Waiting in trio for calls run on a worker thread."""

from __future__ import annotations

import errno
import threading

import pytest
import trio

from natsfs.futures import run_on_thread


def test_run_on_thread_returns_the_result_of_a_call_on_another_thread_or_raises_its_error() -> None:
    async def main() -> None:
        here = threading.get_ident()
        assert await run_on_thread(threading.get_ident) != here
        assert await run_on_thread(lambda: 42) == 42

        def full() -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        with pytest.raises(OSError) as caught:
            await run_on_thread(full)
        assert caught.value.errno == errno.ENOSPC

    trio.run(main)


def test_run_on_thread_is_waited_for_even_when_its_waiter_is_cancelled() -> None:
    """(A write-back close's journal sync: every close waiting on it gets the outcome.)"""
    async def main() -> None:
        release = threading.Event()
        got: list[str] = []

        def slow() -> str:
            release.wait(10)
            return "synced"

        async def cancel_then_release(scope: trio.CancelScope) -> None:
            await trio.sleep(0.05)
            scope.cancel()
            await trio.sleep(0.05)
            release.set()

        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as scope:
                nursery.start_soon(cancel_then_release, scope)
                got.append(await run_on_thread(slow))
                await trio.sleep(1)  # (cancelled here)
        assert got == ["synced"] and scope.cancelled_caught

    trio.run(main)
