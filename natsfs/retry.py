"""The one retry policy: how long to pause between attempts at something the server did not answer.

Every place that retries (a meta publish read back, an idempotent purge, re-opening a watch or its
consumer, the bridge's reconnect) asks a `Backoff` for its next pause instead of keeping its own
arithmetic. Pauses grow exponentially from `first` to `cap`; with a `timeout`, `pause()` is never longer
than the time left and `expired` says when to give up. A `Backoff` only computes: the caller sleeps on
its own loop (trio in the filesystem, asyncio in the bridge's thread, which passes `clock=time.monotonic`),
so one policy serves both. No
library fits better: `stamina`/`tenacity` retry on exceptions around one call, while these loops read
back or re-check state between attempts and must decide per outcome.
"""

from __future__ import annotations

from collections.abc import Callable

import trio


class Backoff:
    """Exponential pauses from `first` to `cap` seconds, within an optional overall `timeout`."""

    def __init__(self, first: float = 0.2, cap: float = 2.0, *, timeout: float | None = None,
                 clock: Callable[[], float] = trio.current_time):
        self.first = first
        self.cap = cap
        self._clock = clock
        self._deadline = None if timeout is None else clock() + timeout
        self._next = first
        self.failures = 0

    @property
    def expired(self) -> bool:
        """The overall timeout has passed (never, without one)."""
        return self._deadline is not None and self._clock() >= self._deadline

    def next_pause(self) -> float:
        """The pause before the next attempt (counted as one more failure)."""
        pause = self._next
        self._next = min(self.cap, self._next * 2)
        self.failures += 1
        if self._deadline is not None:
            pause = max(0.0, min(pause, self._deadline - self._clock()))
        return pause

    def reset(self) -> None:
        """An attempt succeeded: the next failure starts from `first` again."""
        self._next = self.first
        self.failures = 0

    async def pause(self) -> None:
        """Sleep (trio) for `next_pause()`."""
        await trio.sleep(self.next_pause())
