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

import signal
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


class Restarts:
    """When to start a helper child process (the upload worker, the kernel notifier) again after it died.

    A child that ran for at least `stable` seconds died of something that happened to it (a kill, the
    OOM killer): it is started again after `first` seconds. One that dies sooner, or cannot be started,
    counts as a failed restart: the pauses grow (a `Backoff` up to `cap`) so that a child that dies at
    once every time cannot spin, and after `give_up_after` of them in a row `failing` turns True (once per
    streak: the caller says so at ERROR, then keeps its fallback and only retries every `cap` seconds).
    Only computes, like `Backoff`: the caller sleeps."""

    def __init__(self, *, first: float = 0.25, cap: float = 60.0, stable: float = 10.0, give_up_after: int = 5,
                 clock: Callable[[], float] = trio.current_time):
        self.cap = cap
        self.stable = stable
        self.give_up_after = give_up_after
        self._backoff = Backoff(first, cap, clock=clock)
        self._server_backoff = Backoff(first, cap, clock=clock)  # (see `no_server`)
        self._clock = clock
        self._started_at: float | None = None
        self.failing = False  # the last `give_up_after` (or more) starts all failed

    @property
    def failures(self) -> int:
        """Failed restarts in a row (a death after a stable run is not one)."""
        return max(0, self._backoff.failures - 1)

    def started(self) -> None:
        """A new child is running."""
        self._started_at = self._clock()

    def died(self) -> float:
        """The child died, or could not be started: the pause before the next start."""
        lived = None if self._started_at is None else self._clock() - self._started_at
        self._started_at = None
        if lived is not None and lived >= self.stable:
            self.failing = False
            self._backoff.reset()
            self._server_backoff.reset()
        return self._backoff.next_pause()

    def no_server(self) -> float:
        """The child ended because it could reach no server (the daemon's own connection says that
        outage once): no failure of the child, so not counted toward `failing`; the pause before the
        next start grows as for failed restarts, apart from them."""
        self._started_at = None
        return self._server_backoff.next_pause()

    def newly_failing(self) -> bool:
        """True once per streak: the restart that just failed was the `give_up_after`-th in a row."""
        if not self.failing and self.failures >= self.give_up_after:
            self.failing = True
            return True
        return False


def describe_exit(returncode: int | None) -> str:
    """How a child process ended, for a log line: "killed by SIGKILL", "exit status 1"."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


class Silence:
    """Whether a helper child has stopped answering: hung (stopped by SIGSTOP, stuck in a system call)
    rather than dead, which its exit would say.

    The caller says when it asks the child something (`asked`), when any answer comes (`answered`) and
    when it withdraws a question (`withdrawn`: cancelled, it expects no answer). The child is `hung` once
    something has waited `limit` seconds with no answer of any kind meanwhile. That measures progress,
    not how long one question takes: a child busy with a long request is not hung as long as it answers
    something (the upload worker's event loop answers pings while it sends). Only computes, like
    `Backoff`: the caller sleeps (`due`) and kills."""

    def __init__(self, limit: float, clock: Callable[[], float] = trio.current_time):
        self.limit = limit
        self._clock = clock
        self.waiting = 0  # questions asked and neither answered nor withdrawn
        self._since: float | None = None  # when the current wait for an answer began (None: nothing waits)

    def asked(self) -> None:
        if self.waiting == 0:
            self._since = self._clock()
        self.waiting += 1

    def answered(self) -> None:
        """An answer came: the child is alive; what still waits is timed from now."""
        self.waiting = max(0, self.waiting - 1)
        self._since = self._clock() if self.waiting else None

    def withdrawn(self) -> None:
        """A question that will get no answer we wait for (it was cancelled): no progress."""
        self.waiting = max(0, self.waiting - 1)
        if not self.waiting:
            self._since = None

    @property
    def silent_for(self) -> float:
        """Seconds something has waited with no answer meanwhile (0 when nothing waits)."""
        return 0.0 if self._since is None else max(0.0, self._clock() - self._since)

    @property
    def hung(self) -> bool:
        return self._since is not None and self.silent_for >= self.limit

    def due(self) -> float:
        """Seconds until it would be `hung` if no answer came (inf when nothing waits)."""
        return float("inf") if self._since is None else max(0.0, self.limit - self.silent_for)
