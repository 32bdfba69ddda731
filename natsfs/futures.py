"""Waiting in trio for work that finishes on another thread (a `concurrent.futures.Future`, or a call
handed to one of trio's worker threads)."""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

T = TypeVar("T")


async def wait_future(fut: concurrent.futures.Future[T]) -> T:
    """The future's result, without blocking the trio thread; cancelling the waiter cancels the future."""
    try:
        await wait_done(fut)
    except BaseException:
        fut.cancel()
        raise
    return fut.result()


async def wait_done(fut: concurrent.futures.Future[Any]) -> None:
    """Wait until `fut` is done, without blocking the trio thread; cancelling the waiter leaves the
    future as it is (for work that must run whoever waits for it)."""
    done = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def wake(_: Any) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(done.set)

    fut.add_done_callback(wake)
    await done.wait()


async def run_on_thread(fn: Callable[[], T]) -> T:
    """`fn()` on one of trio's cached worker threads; its result or exception. Not cancellable: the
    caller shields the wait (a write-back close's journal sync, whose closes must all get the answer).
    `trio.to_thread.run_sync` costs about 40 us more per call in the daemon (its capacity limiter,
    context copy and support for calls back into trio; 115 against 72 us around a journal sync, measured
    2026-11-24), which each write-back close pays on its way."""
    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()

    def deliver(result: outcome.Outcome[T]) -> None:
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)

    trio.lowlevel.start_thread_soon(fn, deliver)
    return await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
