"""`Streams` on a real JetStream server: the JSON API, direct gets, publishes and push consumers.

Everything goes through `natsfs.bridge`; this module only builds requests and reads replies. It owns
the consumer mechanics the ADR-20 layer should not care about: ephemeral ordered push consumers,
sequence-gap and stall detection with transparent re-creation, and headers-only scans.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

import trio

from .bridge import Bridge, Msg, Subscription
from .errors import (
    ERR_STREAM_NOT_FOUND,
    ERR_WRONG_LAST_SEQUENCE,
    Conflict,
    JetStreamAPIError,
    NatsFSError,
    NoSpace,
    NotFound,
    ReadOnly,
    Unavailable,
)
from .streams import AccountLimits, StoredMsg, StreamState, WatchBatch, parse_rfc3339_ns

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
# A consumer that has sent neither data nor heartbeat for this long is presumed gone and re-created.
STALL_S = 3.5


def _stream_state(info: dict[str, Any]) -> StreamState:
    st = info.get("state") or {}
    created = info.get("created")
    return StreamState(
        name=info["config"]["name"],
        config=info["config"],
        messages=int(st.get("messages", 0)),
        bytes=int(st.get("bytes", 0)),
        first_seq=int(st.get("first_seq", 0)),
        last_seq=int(st.get("last_seq", 0)),
        created_ns=parse_rfc3339_ns(created) if created else 0,
    )


def map_publish_error(e: JetStreamAPIError, subject: str) -> NatsFSError:
    """Turn a publish rejection into the domain error that carries the right errno."""
    desc = e.description.lower()
    if e.err_code == ERR_WRONG_LAST_SEQUENCE or "wrong last sequence" in desc:
        return Conflict(f"{subject}: changed by another client ({e.description})")
    if "sealed" in desc:
        return ReadOnly(f"{subject}: bucket is sealed")
    if "maximum bytes" in desc or "resource" in desc or "exceeded" in desc or "storage" in desc:
        return NoSpace(f"{subject}: refused by the server: {e.description}")
    return e


def _parse_ack_reply(reply: str) -> tuple[int, int, int, int]:
    """(stream seq, consumer seq, timestamp ns, pending) from a `$JS.ACK...` reply subject."""
    t = reply.split(".")
    # v1: $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
    # v2: $JS.ACK.<domain>.<acchash>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>.<rand>
    base = 5 if len(t) == 9 else 7
    return int(t[base]), int(t[base + 1]), int(t[base + 2]), int(t[base + 3])


class JetStreams:
    """The `natsfs.streams.Streams` protocol over a connected `Bridge`."""

    def __init__(self, bridge: Bridge):
        self.bridge = bridge

    # ---------------------------------------------------------------- streams
    async def stream_names(self) -> list[str]:
        names: list[str] = []
        offset = 0
        while True:
            reply = await self.bridge.api("STREAM.NAMES", {"offset": offset})
            page = reply.get("streams") or []
            names.extend(page)
            offset += len(page)
            if not page or offset >= int(reply.get("total", 0)):
                return names

    async def stream_info(self, name: str) -> StreamState:
        try:
            return _stream_state(await self.bridge.api(f"STREAM.INFO.{name}"))
        except JetStreamAPIError as e:
            if e.err_code == ERR_STREAM_NOT_FOUND or e.code == 404:
                raise NotFound(f"no stream {name}") from None
            raise

    async def create_stream(self, config: dict[str, Any]) -> StreamState:
        return _stream_state(await self.bridge.api(f"STREAM.CREATE.{config['name']}", config))

    async def update_stream(self, config: dict[str, Any]) -> StreamState:
        return _stream_state(await self.bridge.api(f"STREAM.UPDATE.{config['name']}", config))

    async def delete_stream(self, name: str) -> None:
        try:
            await self.bridge.api(f"STREAM.DELETE.{name}")
        except JetStreamAPIError as e:
            if e.err_code == ERR_STREAM_NOT_FOUND or e.code == 404:
                raise NotFound(f"no stream {name}") from None
            raise

    async def account_limits(self) -> AccountLimits:
        info = await self.bridge.api("INFO")
        limits = info.get("limits") or {}
        return AccountLimits(
            max_storage=int(limits.get("max_storage", -1)),
            max_memory=int(limits.get("max_memory", -1)),
            storage_used=int(info.get("storage", 0)),
            memory_used=int(info.get("memory", 0)),
        )

    # ---------------------------------------------------------------- messages
    async def publish(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> int:
        try:
            ack = await self.bridge.js_publish(subject, data, headers)
        except JetStreamAPIError as e:
            raise map_publish_error(e, subject) from None
        except NotFound:
            raise NotFound(f"no stream takes {subject}") from None
        return int(ack["seq"])

    async def publish_many(self, msgs: Sequence[tuple[str, bytes]], window: int = 32) -> list[int]:
        results = await self.bridge.js_publish_many([(s, d, None) for s, d in msgs], window)
        seqs: list[int] = []
        for subject_data, r in zip(msgs, results, strict=True):
            if isinstance(r, JetStreamAPIError):
                raise map_publish_error(r, subject_data[0])
            if isinstance(r, NatsFSError):
                raise r
            seqs.append(int(r["seq"]))
        return seqs

    async def purge_subject(self, stream: str, subject: str) -> None:
        await self.bridge.api(f"STREAM.PURGE.{stream}", {"filter": subject})

    async def last_msg(self, stream: str, subject: str) -> StoredMsg | None:
        m = await self.bridge.request(f"$JS.API.DIRECT.GET.{stream}.{subject}")
        if m.status == "404":
            return None
        if m.status is not None and not m.data and "Nats-Sequence" not in (m.headers or {}):
            raise Unavailable(f"direct get {stream} {subject}: status {m.status} {m.headers}")
        return _direct_msg(m)

    async def get_batch(self, stream: str, subject: str, start_seq: int, batch: int,
                        max_bytes: int) -> list[StoredMsg]:
        body = {"seq": max(start_seq, 1), "next_by_subj": subject, "batch": batch, "max_bytes": max_bytes}

        replies = await self.bridge.request_many(f"$JS.API.DIRECT.GET.{stream}", json.dumps(body).encode())
        out: list[StoredMsg] = []
        for m in replies:
            if m.headers and "Nats-Sequence" in m.headers:
                out.append(_direct_msg(m))
            elif m.status in ("404", "408"):
                break
            else:
                raise Unavailable(f"direct get batch {stream} {subject}: status {m.status}")
        return out

    async def stream_batch(self, stream: str, subject: str, start_seq: int, batch: int,
                           max_bytes: int) -> BatchStream:
        """Like `get_batch`, but hands messages over as they arrive instead of all at the end."""
        body = {"seq": max(start_seq, 1), "next_by_subj": subject, "batch": batch, "max_bytes": max_bytes}
        sub = await self.bridge.request_stream(f"$JS.API.DIRECT.GET.{stream}", json.dumps(body).encode())
        return BatchStream(sub, self.bridge.request_timeout, f"{stream} {subject}")

    async def subject_index(self, stream: str, subject: str) -> list[tuple[int, int]]:
        """(sequence, payload size) of every message on `subject`, without fetching payloads."""
        scan = _ConsumerStream(self.bridge, stream, subject, deliver_policy="all", headers_only=True)
        await scan.start()
        out: list[tuple[int, int]] = []
        try:
            while not scan.caught_up:
                batch = await scan.next_batch(timeout=self.bridge.request_timeout)
                if batch.reset:
                    out.clear()
                for m in batch.msgs:
                    out.append((m.seq, int((m.headers or {}).get("Nats-Msg-Size", "0"))))
                if batch.caught_up:
                    break
                if not batch.msgs and scan.idle_for() > self.bridge.request_timeout:
                    raise Unavailable(f"scan of {subject} got no messages")
        finally:
            await scan.close()
        return out

    async def watch(self, stream: str, filter_subject: str, *, last_per_subject: bool = True) -> _ConsumerStream:
        w = _ConsumerStream(self.bridge, stream, filter_subject,
                            deliver_policy="last_per_subject" if last_per_subject else "all")
        await w.start()
        return w


class BatchStream:
    """The replies of one batched direct get, in arrival order; `next()` is None after the last."""

    def __init__(self, sub: Subscription, timeout: float, what: str):
        self._sub = sub
        self._timeout = timeout
        self._what = what
        self.done = False

    async def next(self) -> list[StoredMsg] | None:
        if self.done:
            return None
        msgs = await self._sub.next_batch(self._timeout)
        if not msgs:
            await self.close()
            raise Unavailable(f"direct get batch {self._what}: no reply in {self._timeout:g}s")
        out: list[StoredMsg] = []
        for m in msgs:
            if m.headers and "Nats-Sequence" in m.headers:
                out.append(_direct_msg(m))
                continue
            self.done = True
            await self.close()
            if m.status not in ("204", "404", "408"):
                raise Unavailable(f"direct get batch {self._what}: status {m.status}")
            break
        return out

    async def close(self) -> None:
        self.done = True
        await self._sub.unsubscribe()


def _direct_msg(m: Msg) -> StoredMsg:
    h = m.headers or {}
    ts = h.get("Nats-Time-Stamp")
    headers = {k: v for k, v in h.items() if not k.startswith("Nats-") or k in ("Nats-Rollup",)} or None
    return StoredMsg(int(h["Nats-Sequence"]), h.get("Nats-Subject", ""), headers, m.data,
                     parse_rfc3339_ns(ts) if ts else 0)


class _ConsumerStream:
    """An ordered push consumer: delivers every message in order, re-created on gaps and stalls.

    After a re-creation it resumes at the stream sequence after the last one delivered, so the
    consumer of this stream never sees a message twice or misses one (unless the stream itself
    lost it, in which case `reset` is reported and delivery starts over).
    """

    def __init__(self, bridge: Bridge, stream: str, filter_subject: str, *, deliver_policy: str,
                 headers_only: bool = False):
        self.bridge = bridge
        self.stream = stream
        self.filter_subject = filter_subject
        self.deliver_policy = deliver_policy
        self.headers_only = headers_only
        self.caught_up = False
        self._sub: Subscription | None = None
        self._consumer: str | None = None
        self._cseq = 0
        self._last_sseq = 0
        self._last_activity = time.monotonic()
        self._pending_reset = False

    def idle_for(self) -> float:
        return time.monotonic() - self._last_activity

    async def start(self) -> None:
        await self._create(resume=False)

    async def _create(self, *, resume: bool) -> None:
        if self._sub is not None:
            await self._drop()
        inbox = self.bridge.new_inbox()
        self._sub = await self.bridge.subscribe(inbox)
        config: dict[str, Any] = {
            "deliver_subject": inbox,
            "filter_subject": self.filter_subject,
            "ack_policy": "none",
            "replay_policy": "instant",
            "idle_heartbeat": int(HEARTBEAT_S * 1e9),
            "mem_storage": True,
            "num_replicas": 1,
            "inactive_threshold": int(30e9),
        }
        if self.headers_only:
            config["headers_only"] = True
        if resume and self._last_sseq:
            config["deliver_policy"] = "by_start_sequence"
            config["opt_start_seq"] = self._last_sseq + 1
        else:
            config["deliver_policy"] = self.deliver_policy
        try:
            info = await self.bridge.api(f"CONSUMER.CREATE.{self.stream}",
                                         {"stream_name": self.stream, "config": config})
        except JetStreamAPIError as e:
            await self._sub.unsubscribe()
            self._sub = None
            if e.err_code == ERR_STREAM_NOT_FOUND or e.code == 404:
                raise NotFound(f"no stream {self.stream}") from None
            raise
        self._consumer = info["name"]
        self._cseq = 0
        self._last_activity = time.monotonic()
        if int(info.get("num_pending", 0)) == 0 and not resume:
            self.caught_up = True

    async def _drop(self) -> None:
        sub, name = self._sub, self._consumer
        self._sub, self._consumer = None, None
        if sub is not None:
            await sub.unsubscribe()
        if name is not None:
            try:
                with trio.move_on_after(2):
                    await self.bridge.api(f"CONSUMER.DELETE.{self.stream}.{name}")
            except NatsFSError:
                pass  # it expires by itself (inactive_threshold)

    async def close(self) -> None:
        with trio.CancelScope(shield=True):
            await self._drop()

    async def recreate(self) -> None:
        """Resume from the last delivered sequence with a fresh consumer (after a gap, stall or reconnect)."""
        await self._create(resume=bool(self._last_sseq))

    async def next_batch(self, timeout: float | None = None) -> WatchBatch:
        out = WatchBatch()
        if self._pending_reset:
            self._pending_reset = False
            out.reset = True
        if self._sub is None:
            await self.recreate()
        assert self._sub is not None
        wait = STALL_S if timeout is None else min(timeout, STALL_S)
        msgs = await self._sub.next_batch(wait)
        if msgs:
            self._last_activity = time.monotonic()
        for m in msgs:
            if m.status is not None:
                if m.status == "100":
                    last_c = (m.headers or {}).get("Nats-Last-Consumer")
                    if last_c is not None and int(last_c) != self._cseq:
                        log.info("watch %s: heartbeat shows missed messages; re-creating consumer",
                                 self.filter_subject)
                        await self.recreate()
                        return out
                continue
            if not m.reply.startswith("$JS.ACK."):
                continue
            sseq, cseq, ts, pending = _parse_ack_reply(m.reply)
            if cseq != self._cseq + 1:
                log.info("watch %s: consumer sequence gap (%d after %d); re-creating", self.filter_subject,
                         cseq, self._cseq)
                await self.recreate()
                return out
            self._cseq = cseq
            self._last_sseq = sseq
            headers = m.headers
            if headers is not None:
                headers = {k: v for k, v in headers.items() if k != "Nats-Msg-Size" or self.headers_only}
            out.msgs.append(StoredMsg(sseq, m.subject, headers or None, m.data, ts))
            if pending == 0:
                self.caught_up = True
        if self.caught_up:
            out.caught_up = True
        if not msgs and self.idle_for() > STALL_S:
            log.warning("watch %s: no heartbeat for %.1fs; re-creating consumer", self.filter_subject,
                        self.idle_for())
            try:
                await self.recreate()
            except NotFound:
                raise
            except NatsFSError as e:
                log.warning("watch %s: re-create failed: %s", self.filter_subject, e)
                self._last_activity = time.monotonic()
        return out
