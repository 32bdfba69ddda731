"""The transport's pieces without a server: the reply budget, reply routing, error classification, nats-py checks."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import trio

from natsfs import bridge as bridge_mod
from natsfs import natscompat
from natsfs.bridge import MIN_REPLY_BUDGET, _ByteBudget, _Link, _Reply
from natsfs.errors import (
    Conflict,
    JetStreamAPIError,
    NoSpace,
    OutcomeUnknown,
    ReadOnly,
    TooBig,
    Unavailable,
)
from natsfs.jetstream import map_publish_error

MiB = 1024 * 1024


def test_budget_is_first_come_first_served_and_never_passes_its_limit():
    async def main() -> None:
        budget = _ByteBudget(8 * MiB)
        order: list[str] = []
        assert await budget.acquire(6 * MiB) == 6 * MiB

        async def take(name: str, n: int) -> None:
            got = await budget.acquire(n)
            order.append(name)
            assert budget.used <= budget.limit
            await trio.sleep(0.01)
            budget.release(got)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(take, "big", 4 * MiB)
            await trio.sleep(0.01)
            nursery.start_soon(take, "small", 1 * MiB)  # would fit now, but waits its turn
            await trio.sleep(0.01)
            assert order == []
            budget.release(6 * MiB)
        assert sorted(order) == ["big", "small"]
        assert budget.used == 0
        # A request over the whole budget gets all of it, alone.
        assert await budget.acquire(100 * MiB) == 8 * MiB
        budget.release(8 * MiB)

    trio.run(main)


def test_budget_cancelled_waiter_gives_way():
    async def main() -> None:
        budget = _ByteBudget(4 * MiB)
        held = await budget.acquire(4 * MiB)
        with trio.move_on_after(0.05):
            await budget.acquire(MiB)
        budget.release(held)
        assert budget.used == 0
        assert await budget.acquire(4 * MiB) == 4 * MiB

    trio.run(main)


def test_budget_halves_after_a_loss_and_grows_back(monkeypatch):
    async def main() -> None:
        budget = _ByteBudget(32 * MiB)
        for _ in range(10):
            budget.shrink()
        assert budget.limit == MIN_REPLY_BUDGET
        monkeypatch.setattr(bridge_mod, "_BUDGET_REGROW_S", 0.0)
        assert await budget.acquire(MiB) == MiB
        assert budget.limit == 2 * MIN_REPLY_BUDGET

    trio.run(main)


def test_replies_to_an_earlier_inbox_complete_nothing():
    async def main() -> None:
        link = _Link(["nats://127.0.0.1:1"], name="t", connect_timeout=1)
        link.prefix = "_INBOX.new"
        waiter = _Reply("subj", ack=True)
        link.waiters["1"] = waiter
        msg = SimpleNamespace(subject="_INBOX.old.1", reply="", headers=None, data=b"stale")
        await link._on_reply(msg)
        assert not waiter.fut.done()
        await link._on_reply(SimpleNamespace(subject="_INBOX.newer.1", reply="", headers=None, data=b"x"))
        assert not waiter.fut.done()
        await link._on_reply(SimpleNamespace(subject="_INBOX.new.1", reply="", headers=None, data=b"ok"))
        assert waiter.fut.result().data == b"ok"
        assert "1" not in link.waiters

    asyncio.run(main())


def test_losing_the_client_fails_acks_as_outcome_unknown_and_requests_as_unavailable():
    async def main() -> None:
        link = _Link(["nats://127.0.0.1:1"], name="t", connect_timeout=1, quiet=True)
        link._ready = asyncio.Event()
        closed = SimpleNamespace(last_error="nats: unexpected EOF", is_closed=True, _flush_queue=None)
        link.nc, link.prefix = closed, "_INBOX.a"
        ack, request = _Reply("$O.b.C.x", ack=True), _Reply("$JS.API.INFO", ack=False)
        link.waiters.update({"1": ack, "2": request})
        link._closing = False
        link._reconnect = _no_reconnect  # type: ignore[method-assign]
        link._bury = _no_bury  # type: ignore[method-assign]  # (a stand-in client: nothing of nats-py to end)
        link._lost(closed)
        assert isinstance(ack.fut.exception(), OutcomeUnknown)
        exc = request.fut.exception()
        assert isinstance(exc, Unavailable) and not isinstance(exc, OutcomeUnknown)
        assert link.nc is None and link.prefix == "" and link.generation == 1 and not link.waiters
        await asyncio.sleep(0)

    asyncio.run(main())


async def _no_reconnect(since: float) -> None:
    return None


async def _no_bury(nc: object) -> None:
    return None


@pytest.mark.parametrize(("err_code", "expected"), [
    (10071, Conflict), (10164, Conflict), (10109, ReadOnly), (10077, NoSpace), (10002, NoSpace),
    (10023, NoSpace), (10047, NoSpace), (10028, NoSpace), (10054, TooBig), (10097, TooBig),
    (10158, OutcomeUnknown),
])
def test_publish_errors_are_classified_by_err_code(err_code, expected):
    # The description says nothing useful on purpose: only the err_code may decide.
    assert isinstance(map_publish_error(JetStreamAPIError("x", code=400, err_code=err_code), "s"), expected)


def test_publish_error_text_alone_decides_nothing():
    e = JetStreamAPIError("maximum bytes exceeded, wrong last sequence, sealed", code=500, err_code=10999)
    assert map_publish_error(e, "s") is e


def test_installed_nats_py_has_what_natscompat_uses():
    natscompat.check()
    import nats.aio.client

    assert nats.aio.client.DEFAULT_BUFFER_SIZE >= natscompat.READ_BUFFER


def test_natscompat_refuses_an_unchecked_version(monkeypatch):
    monkeypatch.setattr(natscompat, "_version", lambda: (2, 17))
    with pytest.raises(natscompat.IncompatibleNatsPy, match=r"nats-py >=2\.9,<2\.17, found 2\.17"):
        natscompat.check()


def test_natscompat_names_what_is_missing(monkeypatch):
    import nats.aio.client

    monkeypatch.delattr(nats.aio.client.Client, "_process_msg")
    with pytest.raises(natscompat.IncompatibleNatsPy, match="_process_msg"):
        natscompat.check()
