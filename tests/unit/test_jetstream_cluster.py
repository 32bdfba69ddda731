"""JetStreams on a replicated stream, against a scripted bridge: reads carry the client's floor
(`min_last_seq`), publishes wait out a leader election, and the JetStream API is asked again."""

from __future__ import annotations

import base64
import json
import logging
from typing import Any

import pytest
import trio
import trio.testing

from natsfs import jetstream
from natsfs.bridge import Msg
from natsfs.errors import JetStreamAPIError, NoConnection, NotFound, Unavailable
from natsfs.jetstream import JetStreams


def direct_reply(seq: int, subject: str, data: bytes) -> Msg:
    return Msg(subject="_INBOX", reply="", headers={"Nats-Sequence": str(seq), "Nats-Subject": subject,
                                                    "Nats-Time-Stamp": "2026-11-23T00:00:00Z"}, data=data)


def status(code: str) -> Msg:
    return Msg(subject="_INBOX", reply="", headers={"Status": code}, data=b"")


class ScriptedBridge:
    """Answers with what a test queued; records every request."""

    request_timeout = 10.0
    max_batch_bytes = 64 << 20
    on_reconnect = None

    def __init__(self) -> None:
        self.requests: list[tuple[str, bytes]] = []
        self.replies: list[Msg] = []
        self.publish_replies: list[Any] = []
        self.api_replies: list[Any] = []
        self.api_calls: list[tuple[str, Any]] = []

    async def request(self, subject: str, payload: bytes = b"", headers: Any = None, timeout: Any = None) -> Msg:
        self.requests.append((subject, payload))
        return self.replies.pop(0)

    async def request_many(self, subject: str, payload: Any = b"", timeout: Any = None,
                           max_bytes: Any = None) -> list[Msg]:
        self.requests.append((subject, payload(max_bytes) if callable(payload) else payload))
        return [self.replies.pop(0)]

    async def js_publish(self, subject: str, payload: bytes, headers: Any = None, timeout: Any = None) -> Any:
        r = self.publish_replies.pop(0)
        if isinstance(r, Exception):
            raise r
        return r

    async def js_publish_many(self, msgs: Any, window: int = 32, timeout: Any = None) -> list[Any]:
        return [self.publish_replies.pop(0) for _ in msgs]

    async def api(self, subject: str, body: Any = None, timeout: Any = None) -> dict[str, Any]:
        self.api_calls.append((subject, body))
        r = self.api_replies.pop(0)
        if isinstance(r, Exception):
            raise r
        return r


@pytest.fixture(autouse=True)
def quick_failover(monkeypatch):
    monkeypatch.setattr(jetstream, "_FAILOVER_PAUSE_S", 0.001)


def test_chunk_reads_after_a_write_ask_for_at_least_the_written_sequence():
    bridge = ScriptedBridge()
    js = JetStreams(bridge)  # type: ignore[arg-type]

    async def main() -> None:
        bridge.replies.append(direct_reply(3, "$O.b.C.n", b"old"))
        await js.get_batch("OBJ_b", "$O.b.C.n", 1, 8, 1 << 20)
        assert "min_last_seq" not in json.loads(bridge.requests[-1][1])  # nothing seen yet: no floor
        bridge.publish_replies.append({"stream": "OBJ_b", "seq": 41})
        await js.publish("$O.b.M.x", b"new")
        bridge.replies.append(direct_reply(42, "$O.b.C.n", b"chunk"))
        await js.get_batch("OBJ_b", "$O.b.C.n", 1, 8, 1 << 20)
        assert json.loads(bridge.requests[-1][1])["min_last_seq"] == 41
        bridge.publish_replies.extend([{"stream": "OBJ_b", "seq": 50}, {"stream": "OBJ_b", "seq": 51}])
        await js.publish_many([("$O.b.C.m", b"a", None), ("$O.b.C.m", b"b", None)])
        assert js.floors["OBJ_b"] == 51
        assert "OBJ_c" not in js.floors

    trio.run(main)


def test_metas_are_read_from_the_stream_leader():
    """Conflict checks and read-backs must see the latest write: not a direct get, which any replica
    answers, but STREAM.MSG.GET, which only the leader does."""
    bridge = ScriptedBridge()
    js = JetStreams(bridge)  # type: ignore[arg-type]
    hdrs = base64.b64encode(b"NATS/1.0\r\nNats-Rollup: sub\r\nNats-Msg-Id: m1\r\n\r\n").decode()

    async def main() -> None:
        bridge.api_replies.append({"message": {"subject": "$O.b.M.x", "seq": 77, "hdrs": hdrs,
                                               "data": base64.b64encode(b"{}").decode(),
                                               "time": "2026-11-23T05:00:00.5Z"}})
        msg = await js.last_msg("OBJ_b", "$O.b.M.x")
        assert bridge.api_calls[-1] == ("STREAM.MSG.GET.OBJ_b", {"last_by_subj": "$O.b.M.x"})
        # (Nats-Msg-Id kept: a write-back replay tells its own tombstone by it, see ObjectStore.meta_msg_id)
        assert msg is not None and (msg.seq, msg.data, msg.headers) == (77, b"{}", {"Nats-Rollup": "sub",
                                                                                   "Nats-Msg-Id": "m1"})
        assert js.floors["OBJ_b"] == 77
        bridge.api_replies.append(JetStreamAPIError("no message found", code=404, err_code=10037))
        assert await js.last_msg("OBJ_b", "$O.b.M.y") is None

    trio.run(main)


def test_a_floor_is_kept_while_a_replica_catches_up_and_dropped_for_a_recreated_stream():
    bridge = ScriptedBridge()
    js = JetStreams(bridge)  # type: ignore[arg-type]
    js.floors["OBJ_b"] = 900

    def info(last_seq: int) -> dict[str, Any]:
        return {"config": {"name": "OBJ_b"}, "state": {"last_seq": last_seq}}

    async def main() -> None:
        bridge.replies.extend([status("412"), direct_reply(901, "$O.b.C.n", b"chunk")])
        bridge.api_replies.append(info(950))  # a replica behind; the stream is not
        assert [m.seq for m in await js.get_batch("OBJ_b", "$O.b.C.n", 1, 8, 1 << 20)] == [901]
        assert [json.loads(p)["min_last_seq"] for _, p in bridge.requests] == [900, 900]
        bridge.replies.extend([status("412"), direct_reply(2, "$O.b.C.n", b"chunk")])
        bridge.api_replies.append(info(5))  # deleted and created again: sequences started over
        assert [m.seq for m in await js.get_batch("OBJ_b", "$O.b.C.n", 1, 8, 1 << 20)] == [2]
        assert "min_last_seq" not in json.loads(bridge.requests[-1][1])
        assert "OBJ_b" not in js.floors

    trio.run(main)


def test_a_publish_without_responders_waits_for_the_new_leader():
    bridge = ScriptedBridge()
    js = JetStreams(bridge)  # type: ignore[arg-type]

    async def main() -> None:
        bridge.publish_replies.extend([NotFound("no responders"), NotFound("no responders"),
                                       {"stream": "OBJ_b", "seq": 7}])
        bridge.api_replies.extend([{"streams": ["OBJ_b"]}, Unavailable("meta leader lost"), {"streams": ["OBJ_b"]}])
        assert await js.publish("$O.b.M.x", b"doc", {"Nats-Msg-Id": "m1"}) == 7
        assert bridge.api_calls[0] == ("STREAM.NAMES", {"subject": "$O.b.M.x"})

    trio.run(main)


def test_a_publish_no_stream_takes_is_not_found_at_once():
    bridge = ScriptedBridge()
    js = JetStreams(bridge)  # type: ignore[arg-type]

    async def main() -> None:
        bridge.publish_replies.append(NotFound("no responders"))
        bridge.api_replies.append({"streams": None, "total": 0})
        with pytest.raises(NotFound):
            await js.publish("$O.gone.M.x", b"doc")

    trio.run(main)


def test_unacknowledged_chunks_are_sent_again_with_their_ids():
    bridge = ScriptedBridge()
    js = JetStreams(bridge)  # type: ignore[arg-type]
    sent: list[list[Any]] = []
    original = bridge.js_publish_many

    async def recording(msgs: Any, window: int = 32, timeout: Any = None) -> list[Any]:
        sent.append(list(msgs))
        return await original(msgs, window, timeout)

    bridge.js_publish_many = recording  # type: ignore[method-assign]

    async def main() -> None:
        msgs = [("$O.b.C.n", b"a", {"Nats-Msg-Id": "n.0"}), ("$O.b.C.n", b"b", {"Nats-Msg-Id": "n.1"})]
        bridge.publish_replies.extend([{"stream": "OBJ_b", "seq": 1}, Unavailable("connection lost"),
                                       {"stream": "OBJ_b", "seq": 2}])
        assert await js.publish_many(msgs) == [1, 2]
        assert sent[1] == [msgs[1]]

    trio.run(main)


def test_the_api_is_asked_again_while_the_cluster_elects_a_leader():
    bridge = ScriptedBridge()
    js = JetStreams(bridge)  # type: ignore[arg-type]

    async def main() -> None:
        bridge.api_replies.extend([JetStreamAPIError("JetStream system temporarily unavailable", code=503,
                                                     err_code=10008), NotFound("no responders"),
                                   {"streams": ["OBJ_b"], "total": 1}])
        assert await js.stream_names() == ["OBJ_b"]
        bridge.api_replies.append(JetStreamAPIError("stream not found", code=404, err_code=10059))
        with pytest.raises(NotFound):
            await js.stream_info("OBJ_x")

    trio.run(main)


def stream_info(allow_direct: bool) -> dict[str, Any]:
    return {"config": {"name": "OBJ_b", "allow_direct": allow_direct}, "state": {"last_seq": 9}}


def test_no_responders_to_a_direct_get_of_a_stream_that_allows_them_stays_transient():
    """A stream between leaders answers direct gets "no responders": its config says it allows direct
    gets, so the read fails as the server not answering (asked again by the chunk cache)."""
    bridge = ScriptedBridge()
    js = JetStreams(bridge)  # type: ignore[arg-type]

    async def main() -> None:
        bridge.replies.append(status("503"))
        bridge.api_replies.append(stream_info(True))
        with pytest.raises(Unavailable, match="status 503") as e:
            await js.get_batch("OBJ_b", "$O.b.C.n", 1, 8, 1 << 20)
        assert e.value.log_level >= logging.ERROR  # not a stray reply: worth asking again
        assert bridge.api_calls == [("STREAM.INFO.OBJ_b", None)] and not js.no_direct
        # Its config unreadable (the API has no leader either): transient as well.
        bridge.replies.append(status("503"))
        bridge.api_replies.append(Unavailable("no reply"))
        with pytest.raises(Unavailable, match="status 503"):
            await js.get_batch("OBJ_b", "$O.b.C.n", 1, 8, 1 << 20)

    trio.run(main)


def test_no_responders_to_a_direct_get_of_a_deleted_stream_is_no_messages_at_once():
    """A bucket deleted by another client under a reader: its direct gets have no responders and its
    config read says there is no such stream. No messages then (the chunk cache's "chunks of version are
    gone", ESTALE, as for a version purged under the reader), not "status 503" asked again until the
    read's deadline (EIO after 15 s, twice for a kernel read, with an ERROR line)."""
    bridge = ScriptedBridge()
    js = JetStreams(bridge)  # type: ignore[arg-type]

    class NoResponders:
        async def next_batch(self, timeout: Any = None) -> list[Msg]:
            return [status("503")]

        async def unsubscribe(self) -> None:
            pass

    async def request_stream(subject: str, payload: Any = b"", *, max_bytes: int = 0) -> NoResponders:
        bridge.requests.append((subject, b""))
        return NoResponders()

    bridge.request_stream = request_stream  # type: ignore[attr-defined]

    async def main() -> None:
        bridge.replies.append(status("503"))
        bridge.api_replies.append(JetStreamAPIError("stream not found", code=404, err_code=10059))
        assert await js.get_batch("OBJ_b", "$O.b.C.n", 1, 8, 1 << 20) == []
        bridge.api_replies.append(JetStreamAPIError("stream not found", code=404, err_code=10059))
        batches = await js.stream_batch("OBJ_b", "$O.b.C.n", 1, 8, 1 << 20)
        assert await batches.next() is None
        assert bridge.api_calls == [("STREAM.INFO.OBJ_b", None)] * 2 and not js.no_direct
        assert [s for s, _ in bridge.requests] == ["$JS.API.DIRECT.GET.OBJ_b"] * 2  # no STREAM.MSG.GET

    trio.run(main)


def test_a_stream_without_direct_gets_is_read_with_stream_msg_get():
    """"No responders" from a stream whose config does not allow direct gets: the batch is made of
    STREAM.MSG.GET requests (next by subject), chained by sequence, without pending counts; later
    batches go there at once."""
    bridge = ScriptedBridge()
    js = JetStreams(bridge)  # type: ignore[arg-type]
    stored = {3: b"c0", 4: b"c1", 7: b"c2"}  # chunk messages of $O.b.C.n (5 and 6 hold other subjects)
    asked: list[dict[str, Any]] = []
    gone = False

    async def api(subject: str, body: Any = None, timeout: Any = None) -> dict[str, Any]:
        if subject == "STREAM.INFO.OBJ_b":
            return stream_info(False)
        if gone:
            raise JetStreamAPIError("stream not found", code=404, err_code=10059)
        assert subject == "STREAM.MSG.GET.OBJ_b" and body["next_by_subj"] == "$O.b.C.n", (subject, body)
        asked.append(body)
        seq = next((s for s in sorted(stored) if s >= body["seq"]), None)
        if seq is None:
            raise JetStreamAPIError("no message found", code=404, err_code=10037)
        return {"message": {"subject": "$O.b.C.n", "seq": seq, "data": base64.b64encode(stored[seq]).decode(),
                            "time": "2026-11-23T00:00:00Z"}}

    bridge.api = api  # type: ignore[method-assign]

    async def main() -> None:
        bridge.replies.append(status("503"))
        got = await js.get_batch("OBJ_b", "$O.b.C.n", 1, 8, 1 << 20)
        assert [(m.seq, m.subject, bytes(m.data), m.pending) for m in got] == [
            (3, "$O.b.C.n", b"c0", -1), (4, "$O.b.C.n", b"c1", -1), (7, "$O.b.C.n", b"c2", -1)]
        assert js.no_direct == {"OBJ_b"}
        requests = len(bridge.requests)
        batches = await js.stream_batch("OBJ_b", "$O.b.C.n", 4, 2, 1 << 20)
        assert [m.seq for m in (await batches.next() or [])] == [4, 7] and await batches.next() is None
        assert len(bridge.requests) == requests  # no direct get tried again
        assert [m.seq for m in await js.get_batch("OBJ_b", "$O.b.C.n", 1, 8, 3)] == [3, 4]  # max_bytes
        assert all(set(b) == {"seq", "next_by_subj"} for b in asked)
        nonlocal gone
        gone = True  # every request of a round fails: the error surfaces as itself, not as a group
        with pytest.raises(NotFound):
            await js.get_batch("OBJ_b", "$O.b.C.n", 1, 8, 1 << 20)

    trio.run(main)


@pytest.mark.parametrize("request_timeout", [10.0, 2.0])
def test_a_read_only_api_call_without_a_connection_fails_within_the_request_timeout(request_timeout):
    """Each attempt of a read-only call waits at most 3 s; while no connection comes, they end together
    within the request timeout (the documented wait for a connection), not after the failover window."""
    bridge = ScriptedBridge()
    bridge.request_timeout = request_timeout
    js = JetStreams(bridge)  # type: ignore[arg-type]
    attempts: list[float] = []

    async def no_connection(subject: str, body: Any = None, timeout: Any = None) -> dict[str, Any]:
        attempts.append(timeout)
        await trio.sleep(timeout)
        raise NoConnection(f"no connection to NATS (reconnecting for {timeout:g}s and more)")

    bridge.api = no_connection  # type: ignore[method-assign]

    async def main() -> None:
        with pytest.raises(NoConnection):
            await js.stream_info("OBJ_b")
        assert trio.current_time() <= request_timeout
        assert len(attempts) > 1 or request_timeout <= jetstream._READ_ATTEMPT_S

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
