"""The bucket watch's consumer (jetstream._ConsumerStream) during an outage of the connection: the
bridge says `lost the connection to NATS` once; the watch of each bucket must not repeat that outage
as its own warnings (a stall, failed re-creations, the re-creation once the server is back), or a mount
of many buckets logs three lines per bucket for one server restart or password change."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import trio

from natsfs import jetstream
from natsfs.errors import NoConnection, Unavailable


class _Quiet:
    """A subscription that delivers nothing (no heartbeat either: the connection is gone)."""

    async def next_batch(self, wait: float) -> list[Any]:
        return []

    async def unsubscribe(self) -> None:
        pass

    def interrupt(self) -> None:
        pass


class _Bridge:
    connected = False


def _stalled_watch(monkeypatch: pytest.MonkeyPatch, failure: Exception) -> tuple[jetstream._ConsumerStream, list]:
    watch = jetstream._ConsumerStream(_Bridge(), "OBJ_b", "$O.b.M.>", deliver_policy="all")  # type: ignore[arg-type]
    watch._sub = _Quiet()  # type: ignore[assignment]
    watch._last_activity = time.monotonic() - 60
    outcomes: list[Exception | None] = [failure, failure, None]

    async def recreate(*, pull: bool = True) -> None:
        outcome = outcomes.pop(0)
        watch._sub = None  # (as `_create`: the old subscription is dropped first)
        if outcome is not None:
            raise outcome
        watch._sub = _Quiet()  # type: ignore[assignment]

    monkeypatch.setattr(watch, "recreate", recreate)
    return watch, outcomes


async def _through_the_outage(watch: jetstream._ConsumerStream, outcomes: list) -> None:
    await watch.next_batch(timeout=0)  # the stall: re-created, which fails
    for _ in range(2):  # retried once the backoff allows: fails again, then (the server back) succeeds
        watch._retry_at = 0.0
        if len(outcomes) == 1:
            watch.bridge.connected = True  # type: ignore[misc]  # the server is back
        await watch.next_batch(timeout=0)
    assert outcomes == [] and not watch._stale


def test_an_outage_of_the_connection_is_not_repeated_by_the_watch(monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="natsfs")
    watch, outcomes = _stalled_watch(monkeypatch, NoConnection("no connection to NATS (reconnecting for 12s)"))
    trio.run(_through_the_outage, watch, outcomes)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if "watch $O.b.M.>" in r.getMessage()]
    assert [m for _, m in lines] == [
        "watch $O.b.M.>: no heartbeat for 60.0s; re-creating consumer",
        "watch $O.b.M.>: could not re-create the consumer (stalled): no connection to NATS (reconnecting for "
        "12s); retrying",
        "watch $O.b.M.>: could not re-create the consumer (no consumer): no connection to NATS (reconnecting "
        "for 12s); retrying",
        "watch $O.b.M.>: consumer re-created after 2 failed attempts"]
    assert {level for level, _ in lines} == {logging.DEBUG}


def test_a_stall_and_failures_on_a_live_connection_are_still_warnings(monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="natsfs")
    watch, outcomes = _stalled_watch(monkeypatch, Unavailable("JetStream not answering"))
    watch.bridge.connected = True  # type: ignore[misc]
    trio.run(_through_the_outage, watch, outcomes)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if "watch $O.b.M.>" in r.getMessage()]
    assert [level for level, _ in lines] == [logging.WARNING, logging.WARNING, logging.DEBUG, logging.WARNING]
