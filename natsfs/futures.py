"""Waiting in trio for work that finishes on another thread (a `concurrent.futures.Future`)."""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Any, TypeVar

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
