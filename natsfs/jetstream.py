"""`Streams` on a real JetStream server: the JSON API, direct gets, publishes and push consumers.

Everything goes through `natsfs.bridge`; this module only builds requests and reads replies. It owns
the consumer mechanics the ADR-20 layer should not care about: ephemeral ordered push consumers,
sequence-gap and stall detection with transparent re-creation, and headers-only scans.

Streams without direct gets. `$JS.API.DIRECT.GET.<stream>` is answered only by a stream whose config
has `allow_direct` (every bucket natsfs, nats.go and nats-py create today; not one made by an older
client or server, or by hand). For any other stream nothing subscribes to it and the server answers
"503 no responders" at once, which for a stream that does allow direct gets means it is between leaders
(transient). So a 503 is settled by reading the stream's config: a stream that does not allow direct gets
is noted (so is every stream whose info is read), and its batched gets are made of `STREAM.MSG.GET`
requests instead (`_MsgGets`: the first message on the subject at or after a sequence, several sequences
asked at once, the replies chained as a batched direct get would return them). Those replies come from
the stream's leader and carry subject and sequence but no count of the messages after them (`pending`
-1), so the chunk cache proves such a version's layout with a headers-only scan instead of pending
counts (natsfs.chunk_cache).

Headers-only scans (`subject_index`: the sequence and size of every chunk of a version) go over the
bridge's lean connection when the trio thread drives one: a one-shot pull consumer delivers there what
byte-bounded requests from that connection ask for (so a slow reader never has more than a few hundred
KiB waiting on the server), its deliveries checked from their reply subjects in one compiled match each
(`_take_deliveries`). Any doubt, a lost connection or a refusal sends the scan to the ordered consumer
over the main connection. So do listings of many subjects (`subject_counts`, `_scanned_counts`), whose
`STREAM.INFO` reply would come in one piece of up to 100 000 subjects.

Users without direct-get permission. A server that refuses `$JS.API.DIRECT.GET.<stream>` to the user
(a permissions violation, `NotPermitted`) gets the same `STREAM.MSG.GET` requests instead, from then on
for that stream (`direct_refused`); if those are refused too, the read fails with EACCES.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import re
import time
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import trio

from .bridge import Bridge, Deliveries, Msg, Subscription
from .errors import (
    ERR_ACCOUNT_RESOURCES_EXCEEDED,
    ERR_DUPLICATE_IN_PROCESS,
    ERR_HEADER_TOO_BIG,
    ERR_INSUFFICIENT_RESOURCES,
    ERR_MEMORY_RESOURCES_EXCEEDED,
    ERR_MSG_TOO_BIG,
    ERR_NO_MESSAGE_FOUND,
    ERR_STORAGE_RESOURCES_EXCEEDED,
    ERR_STORE_FAILED,
    ERR_STREAM_NOT_FOUND,
    ERR_STREAM_SEALED,
    ERR_WRONG_LAST_MSG_ID,
    ERR_WRONG_LAST_SEQUENCE,
    ERR_WRONG_LAST_SEQUENCE_CONSTANT,
    Conflict,
    InvalidArgument,
    JetStreamAPIError,
    NatsFSError,
    NoConnection,
    NoSpace,
    NotFound,
    NotPermitted,
    OutcomeUnknown,
    ReadOnly,
    TooBig,
    Unavailable,
    WrongLastMsgId,
    single_errors,
)
from .retry import Backoff
from .streams import (
    BATCH_COMMIT,
    BATCH_ID,
    BATCH_SEQUENCE,
    STREAM_UPDATED_ADVISORY,
    AccountLimits,
    CallCounter,
    StoredMsg,
    StreamState,
    WatchBatch,
    check_purge_filter,
    limit_refusal,
    parse_rfc3339_ns,
)

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
# A headers-only scan over the lean connection (`_lean_index`) pulls its deliveries in requests of this
# many bytes (as the server counts them: subject, reply subject and headers of each, about 150 bytes a
# chunk), at most `SCAN_REQUESTS` of them asked for and not yet delivered: the server never holds more
# than that for the scan, however slowly it is read, so it stays far below any `max_pending`.
SCAN_REQUEST_BYTES = 256 * 1024
SCAN_REQUESTS = 2
# An ordered consumer over the main connection (`_ConsumerStream`: a watch's snapshot, the ordered scans)
# catches up the same way: a pull consumer asked for this many bytes a request, at most
# `CATCHUP_REQUESTS` requests' worth asked for and not yet read from the socket; only once it delivered
# what leaves nothing pending is the live push consumer (flow control) made, from the next sequence.
CATCHUP_REQUEST_BYTES = SCAN_REQUEST_BYTES
CATCHUP_REQUESTS = 2
# `subject_counts` lists subjects (`STREAM.INFO`, one reply) only while their estimated reply stays under
# `LISTING_MAX_BYTES`, at the filter's length and `LISTING_ENTRY_BYTES` more a subject (a meta subject's
# name token is 32 characters for a 23-byte name; `"subject":count,` adds a few): about 10 000 metas.
# Larger ones are scanned (a connection's `max_pending` may be a couple of MB, and the server drops the
# connection as a slow consumer for one reply larger than that).
LISTING_MAX_BYTES = 1024 * 1024
LISTING_ENTRY_BYTES = 96
# A consumer that has sent neither data nor heartbeat for this long is presumed gone and re-created.
STALL_S = 3.5
# The least rate (bytes/s) at which the server is expected to store a committed batch: the commit's ack
# may take this long on top of the request timeout.
_BATCH_COMMIT_RATE = 16 * 1024 * 1024
# How long a clustered stream (or the JetStream API) may go without a leader before a publish or an
# API call gives up: a node's loss is followed by an election that takes a few seconds.
FAILOVER_S = 15.0
_FAILOVER_PAUSE_S = 0.25
_FLOOR_TRIES = 20  # direct gets refused for a floor (412) asked again, a pause apart, before failing
ERR_CLUSTER_NOT_AVAILABLE = 10008  # "JetStream system temporarily unavailable" (503)
_READ_ATTEMPT_S = 3.0
_READ_ONLY_API = ("INFO", "STREAM.INFO.", "STREAM.NAMES", "STREAM.LIST", "STREAM.MSG.GET.", "CONSUMER.INFO.")
# `STREAM.MSG.GET` requests in flight at once for one batched get of a stream without direct gets.
MSG_GET_PARALLEL = 8
# Why a direct get had no responders (`Streams._why_no_responders`).
_NO_DIRECT, _GONE, _TRANSIENT = "no direct gets", "no such stream", "transient"


async def _noting_first_subject(msgs: AsyncIterable[tuple[str, bytes, dict[str, str]]], first: list[str]
                                ) -> AsyncIterator[tuple[str, bytes, dict[str, str]]]:
    """`msgs`, noting the subject of the first one in `first` (once something of a batch was sent)."""
    async for msg in msgs:
        if not first:
            first.append(msg[0])
        yield msg


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


_NO_SPACE = frozenset({ERR_STORE_FAILED, ERR_ACCOUNT_RESOURCES_EXCEEDED, ERR_INSUFFICIENT_RESOURCES,
                       ERR_STORAGE_RESOURCES_EXCEEDED, ERR_MEMORY_RESOURCES_EXCEEDED})


def map_publish_error(e: JetStreamAPIError, subject: str) -> NatsFSError:
    """Turn a publish rejection into the domain error that carries the right errno, by its err_code."""
    code = e.err_code
    if code in (ERR_WRONG_LAST_SEQUENCE, ERR_WRONG_LAST_SEQUENCE_CONSTANT):
        return Conflict(f"{subject}: changed by another client ({e.description})")
    if code == ERR_WRONG_LAST_MSG_ID:
        return WrongLastMsgId(f"{subject}: not stored, another message came before it ({e.description})")
    if code == ERR_STREAM_SEALED:
        return ReadOnly(f"{subject}: bucket is sealed")
    if code in _NO_SPACE:
        return NoSpace(limit_refusal(subject, e.description))
    if code in (ERR_MSG_TOO_BIG, ERR_HEADER_TOO_BIG):
        return TooBig(f"{subject}: refused by the server: {e.description}")
    if code == ERR_DUPLICATE_IN_PROCESS:
        return OutcomeUnknown(f"{subject}: a publish with the same id is still in process ({e.description})")
    return e


def _batch_ack(data: bytes | bytearray, subject: str) -> int:
    """The sequence in a batch message's reply (0 when the reply is empty, as for a message inside a
    batch), or the refusal it carries as a domain error."""
    try:
        reply = json.loads(data) if data else {}
    except ValueError:
        raise Unavailable(f"unreadable reply to a batch publish on {subject}: {data[:80]!r}") from None
    err = reply.get("error") if isinstance(reply, dict) else None
    if err:
        e = JetStreamAPIError(str(err.get("description", "error")), code=int(err.get("code", 0)),
                              err_code=int(err.get("err_code", 0)))
        raise map_publish_error(e, subject)
    return int(reply.get("seq", 0)) if isinstance(reply, dict) else 0


def _parse_ack_reply(reply: str) -> tuple[int, int, int, int]:
    """(stream seq, consumer seq, timestamp ns, pending) from a `$JS.ACK...` reply subject."""
    t = reply.split(".")
    # v1: $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>
    # v2: $JS.ACK.<domain>.<acchash>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>.<rand>
    base = 5 if len(t) == 9 else 7
    return int(t[base]), int(t[base + 1]), int(t[base + 2]), int(t[base + 3])


class JetStreams:
    """The `natsfs.streams.Streams` protocol over a connected `Bridge`."""

    def __init__(self, bridge: Bridge) -> None:
        self.bridge = bridge
        # Calls per method, and `batch_msgs`: messages sent as requests inside atomic batches (each one a
        # round trip); shown in the daemon's stats, like `MemoryStreams.calls`.
        self.calls = CallCounter()
        # Per stream, the highest sequence this client has seen stored (acks, watch deliveries, reads).
        # Direct gets carry it as `min_last_seq`: on a replicated stream any replica may answer, and
        # one that has not applied that far yet hands the request to the leader instead of answering
        # from the past (server >= 2.12, ADR-31/read-after-write). So a client reads its own writes,
        # and every object its watch announced, from any node.
        self.floors: dict[str, int] = {}
        # Streams whose config does not allow direct gets (`allow_direct` false): read with STREAM.MSG.GET.
        self.no_direct: set[str] = set()
        # Streams whose direct gets the server refuses this user (permissions): read with STREAM.MSG.GET.
        self.direct_refused: set[str] = set()
        # The server refused a scan over the lean connection (its subscription, or the consumer): scans go
        # over the main connection from then on (`subject_index`).
        self._lean_scans_refused = False
        # Streams whose consumers the server refuses this user pull requests of: their ordered consumers
        # catch up as push consumers, as they all did before (`_ConsumerStream`).
        self._pulls_refused: set[str] = set()
        # Open watches and scans, told when the connection is replaced (their consumers may be gone).
        self._watches: weakref.WeakSet[_ConsumerStream] = weakref.WeakSet()
        previous = bridge.on_reconnect

        def reconnected() -> None:
            for w in list(self._watches):
                w.mark_stale()
            if previous is not None:
                previous()

        bridge.on_reconnect = reconnected

    @property
    def connected(self) -> bool:
        return self.bridge.connected

    async def _api(self, subject: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return await _api(self.bridge, subject, body)

    # ---------------------------------------------------------------- streams
    async def stream_names(self) -> list[str]:
        names: list[str] = []
        offset = 0
        while True:
            reply = await self._api("STREAM.NAMES", {"offset": offset})
            page = reply.get("streams") or []
            names.extend(page)
            offset += len(page)
            if not page or offset >= int(reply.get("total", 0)):
                return names

    async def stream_infos(self) -> list[StreamState]:
        infos: list[StreamState] = []
        offset = 0
        while True:
            self.calls["stream_infos"] += 1
            reply = await self._api("STREAM.LIST", {"offset": offset})
            page = reply.get("streams") or []
            infos.extend(_stream_state(info) for info in page if isinstance(info, dict) and info.get("config"))
            offset += len(page)
            if not page or offset >= int(reply.get("total", 0)):
                return infos

    async def stream_info(self, name: str) -> StreamState:
        self.calls["stream_info"] += 1
        return self._note_config(await _stream_info(self.bridge, name))

    def _note_config(self, st: StreamState, *, refused: bool = False) -> StreamState:
        """Remember whether the stream answers direct gets (see the module docstring). A config without
        the flag at all (a server older than direct gets) counts only once a direct get was `refused`."""
        allowed = st.config.get("allow_direct")
        if allowed:
            self.no_direct.discard(st.name)
        elif (allowed is None and not refused) or st.name in self.no_direct:
            pass
        else:
            self.no_direct.add(st.name)
            log.info("stream %s does not allow direct gets (allow_direct is false): its chunks are read "
                     "through the stream's leader (STREAM.MSG.GET), one message per request", st.name)
        return st

    def _reads_direct(self, stream: str) -> bool:
        return stream not in self.no_direct and stream not in self.direct_refused

    def _direct_not_permitted(self, stream: str, e: NotPermitted) -> None:
        """The server refused this user a direct get on `stream`: its reads go through STREAM.MSG.GET
        from now on (refused too: EACCES). Logged once per stream (the bridge logged the refusal)."""
        if stream not in self.direct_refused:
            self.direct_refused.add(stream)
            log.info("stream %s: the server refuses this user direct gets (%s): its chunks are read through "
                     "the stream's leader (STREAM.MSG.GET), one message per request", stream, e.subject)

    async def _why_no_responders(self, stream: str) -> str:
        """A direct get on `stream` was answered "no responders": why. `NO_DIRECT`: the stream does not
        allow direct gets (its config read once, without waiting out an election); `GONE`: there is no
        such stream (deleted by another client under a reader: it holds no messages, so the read ends as
        for a version purged under it, `ESTALE`, instead of asking again until its deadline, `EIO` after
        15 s); else `TRANSIENT` (a stream between leaders, or not known: asked again by the caller)."""
        if stream in self.no_direct:
            return _NO_DIRECT
        try:
            info = await self.bridge.api(f"STREAM.INFO.{stream}", None,
                                         min(self.bridge.request_timeout, _READ_ATTEMPT_S))
            self._note_config(_stream_state(info), refused=True)
        except JetStreamAPIError as e:
            return _GONE if e.err_code == ERR_STREAM_NOT_FOUND or e.code == 404 else _TRANSIENT
        except (NatsFSError, KeyError, TypeError, ValueError):
            return _TRANSIENT  # not known: taken as the transient kind, as before
        return _NO_DIRECT if stream in self.no_direct else _TRANSIENT

    async def subject_count(self, stream: str, filter_subject: str) -> int:
        """How many subjects matching `filter_subject` hold messages, without listing them.

        (STREAM.INFO with a subjects filter and an offset past the end: the server still counts, but
        sends no subject names.)"""
        return (await self._subject_total(stream, filter_subject))[0]

    async def _subject_total(self, stream: str, filter_subject: str) -> tuple[int, int]:
        """(`subject_count`, the stream's last sequence when counted)."""
        reply = await self._stream_api(stream, {"subjects_filter": filter_subject, "offset": 1 << 31})
        return int(reply.get("total", 0)), int((reply.get("state") or {}).get("last_seq", 0))

    async def subject_counts(self, stream: str, filter_subject: str) -> tuple[dict[str, int], int, bool]:
        """(message count per subject matching `filter_subject`, the stream's last sequence L when listed,
        whether it is `complete`: a subject not counted held no message at some moment after the stream
        ended at L, so a message on it at or below L is gone).

        A listing whose reply could be large is a headers-only scan instead (`_scanned_counts`): the
        server sends `STREAM.INFO`'s subjects in one reply of up to 100 000 of them (4.4 MB for 100 000
        metas), whatever `max_pending` the server has for the connection, which drops it as a slow
        consumer when the reply is larger. A single subject, or few, is listed."""
        if ">" in filter_subject.split(".") or "*" in filter_subject.split("."):
            total, last_seq = await self._subject_total(stream, filter_subject)
            if total * (len(filter_subject) + LISTING_ENTRY_BYTES) > LISTING_MAX_BYTES:
                return await self._scanned_counts(stream, filter_subject, last_seq)
        return await self._listed_counts(stream, filter_subject)

    async def _listed_counts(self, stream: str, filter_subject: str) -> tuple[dict[str, int], int, bool]:
        """`subject_counts` by `STREAM.INFO` listings: one snapshot, or pages of up to 100 000 subjects
        (not complete)."""
        self.calls["subject_listings"] += 1
        counts: dict[str, int] = {}
        offset, pages, last_seq = 0, 0, 0
        while True:
            reply = await self._stream_api(stream, {"subjects_filter": filter_subject, "offset": offset})
            state = reply.get("state") or {}
            page = state.get("subjects") or {}
            if not pages:
                last_seq = int(state.get("last_seq", 0))
            pages += 1
            counts.update(page)
            offset += len(page)
            if not page or offset >= int(reply.get("total", 0)):
                return counts, last_seq, pages == 1

    async def _scanned_counts(self, stream: str, filter_subject: str, last_seq: int
                              ) -> tuple[dict[str, int], int, bool]:
        """`subject_counts` by a headers-only scan of every message on `filter_subject` (a pull consumer,
        `deliver_policy` all, byte-bounded requests: `_lean_scan` over the lean connection, else
        `_ordered_scan` over the main one), begun once the stream ended at `last_seq`.

        Complete when it ran until a delivery left nothing pending: a message at or below `last_seq`
        not delivered was removed before the scan reached it, by a purge of its subject (which was then
        empty) or by a newer message on it (a rollup), stored before the scan ended and so delivered
        in turn or removed the same way. Not complete when other clients store faster than it reads:
        it stops once it delivered as many messages after `last_seq` as before it (and 1000)."""
        self.calls["subject_scans"] += 1
        rows: list[tuple[bytes, int, int | None]] | None = None
        complete = False
        if self.bridge.reads_in_trio and not self._lean_scans_refused:
            try:
                rows, complete = await self._lean_scan(stream, filter_subject, last_seq=last_seq)
            except _ScanDoubt as e:
                log.info("scan of %s over the lean connection: %s; scanning again over the main one",
                         filter_subject, e)
            except NotPermitted as e:
                self._lean_scans_refused = True
                log.info("scans go over the main connection from now on: %s", e)
            except NatsFSError as e:
                log.debug("scan of %s over the lean connection: %s; scanning over the main one", filter_subject, e)
        if rows is None:
            rows, complete = await self._ordered_scan(stream, filter_subject, last_seq=last_seq)
        counts: dict[str, int] = {}
        for subject, _, _ in rows:
            key = subject.decode(errors="surrogateescape")
            counts[key] = counts.get(key, 0) + 1
        return counts, last_seq, complete

    async def _stream_api(self, stream: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return await _api(self.bridge, f"STREAM.INFO.{stream}", body, max(self.bridge.request_timeout, 30.0))
        except JetStreamAPIError as e:
            if e.err_code == ERR_STREAM_NOT_FOUND or e.code == 404:
                raise NotFound(f"no stream {stream}") from None
            raise

    async def create_stream(self, config: dict[str, Any]) -> StreamState:
        self.floors.pop(config["name"], None)
        return self._note_config(_stream_state(await self._api(f"STREAM.CREATE.{config['name']}", config)))

    async def update_stream(self, config: dict[str, Any]) -> StreamState:
        return self._note_config(_stream_state(await self._api(f"STREAM.UPDATE.{config['name']}", config)))

    async def delete_stream(self, name: str) -> None:
        self.floors.pop(name, None)
        self.no_direct.discard(name)
        try:
            await self._api(f"STREAM.DELETE.{name}")
        except JetStreamAPIError as e:
            if e.err_code == ERR_STREAM_NOT_FOUND or e.code == 404:
                raise NotFound(f"no stream {name}") from None
            raise

    async def account_limits(self) -> AccountLimits:
        info = await self._api("INFO")
        limits = info.get("limits") or {}
        return AccountLimits(
            max_storage=int(limits.get("max_storage", -1)),
            max_memory=int(limits.get("max_memory", -1)),
            storage_used=int(info.get("storage", 0)),
            memory_used=int(info.get("memory", 0)),
        )

    # ---------------------------------------------------------------- messages
    async def publish(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> int:
        self.calls["publish"] += 1
        deadline = trio.current_time() + FAILOVER_S
        while True:
            try:
                ack = await self.bridge.js_publish(subject, data, headers)
            except JetStreamAPIError as e:
                raise map_publish_error(e, subject) from None
            except NotFound:
                await self._await_leader(subject, deadline)
                continue
            self._observe(ack)
            return int(ack["seq"])

    def _observe(self, ack: dict[str, Any]) -> None:
        stream, seq = ack.get("stream"), int(ack.get("seq", 0))
        if stream and seq > self.floors.get(stream, 0):
            self.floors[stream] = seq

    def _floor_body(self, stream: str, body: dict[str, Any]) -> dict[str, Any]:
        floor = self.floors.get(stream, 0)
        return {**body, "min_last_seq": floor} if floor else body

    async def _floor_refused(self, stream: str) -> None:
        """A direct get answered 412: the replica that had it had not applied our floor yet (and did not
        hand it to the leader). Ask again, with the floor: reading without it could serve the past.
        Only a stream that now ends before the floor (deleted and created again: its sequences started
        over) makes the floor go."""
        floor = self.floors.get(stream, 0)
        with contextlib.suppress(NotFound):
            if (await self.stream_info(stream)).last_seq < floor:
                log.info("stream %s ends before sequence %d seen earlier (created again); reading without a "
                         "floor", stream, floor)
                self.floors.pop(stream, None)
                return
        await trio.sleep(_FAILOVER_PAUSE_S)

    async def _await_leader(self, subject: str, deadline: float) -> None:
        """A publish to `subject` had no responders. `NotFound` if no stream takes the subject; else the
        stream is clustered and between leaders (a node was lost): pause before the caller sends the same
        message again (its `Nats-Msg-Id` makes that safe), `Unavailable` once `deadline` has passed."""
        try:
            reply = await _api(self.bridge, "STREAM.NAMES", {"subject": subject})
        except Unavailable:
            reply = {"streams": ["?"]}  # the API has no leader either: a cluster in the middle of an election
        if not reply.get("streams"):
            raise NotFound(f"no stream takes {subject}")
        if trio.current_time() >= deadline:
            raise Unavailable(f"the stream taking {subject} has had no leader for {FAILOVER_S:g}s")
        await trio.sleep(_FAILOVER_PAUSE_S)

    @property
    def max_payload(self) -> int:
        """The largest message the server takes (from its INFO)."""
        return self.bridge.max_payload

    @property
    def subject_limit(self) -> int | None:
        """The longest subject the server was found to take (see `Bridge.subject_limit`)."""
        return self.bridge.subject_limit

    async def publish_many(self, msgs: Sequence[tuple[str, bytes, dict[str, str] | None]],
                           window: int = 32) -> list[int]:
        """Publish stream messages (chunks, each with its own `Nats-Msg-Id`), pipelined. Messages that
        got no ack, or no responders while their stream elects a leader, are sent again until
        `FAILOVER_S` has passed: the server's de-duplication keeps a message stored twice out."""
        self.calls["publish_many"] += 1
        results = await self.bridge.js_publish_many(msgs, window)
        deadline = trio.current_time() + FAILOVER_S
        while again := [i for i, r in enumerate(results) if isinstance(r, NotFound | Unavailable)]:
            first = results[again[0]]
            assert isinstance(first, NotFound | Unavailable)
            if isinstance(first, NotFound):
                await self._await_leader(msgs[again[0]][0], deadline)
            elif trio.current_time() >= deadline:
                raise first
            else:
                log.debug("%d of %d publishes got no ack (%s); sending them again", len(again), len(msgs), first)
                await trio.sleep(_FAILOVER_PAUSE_S)
            retried = await self.bridge.js_publish_many([msgs[i] for i in again], window)
            for i, r in zip(again, retried, strict=True):
                results[i] = r
        seqs: list[int] = []
        for (subject, _, _), r in zip(msgs, results, strict=True):
            outcome = self._outcome(subject, r)
            if isinstance(outcome, NatsFSError):
                raise outcome
            seqs.append(outcome)
        return seqs

    def _outcome(self, subject: str, result: dict[str, Any] | NatsFSError) -> int | NatsFSError:
        """A publish's sequence (its ack noted), or the domain error it got."""
        if isinstance(result, JetStreamAPIError):
            return map_publish_error(result, subject)
        if isinstance(result, NatsFSError):
            return result
        self._observe(result)
        return int(result["seq"])

    async def publish_each(self, msgs: Sequence[tuple[str, bytes, dict[str, str] | None]]
                           ) -> list[int | NatsFSError]:
        """See `Streams.publish_each`: one pipelined send over the connection, in order."""
        self.calls["publish_each"] += 1
        results = await self.bridge.js_publish_many(msgs, len(msgs))
        return [self._outcome(subject, r) for (subject, _, _), r in zip(msgs, results, strict=True)]

    async def publish_batch(self, batch_id: str,
                            messages: Callable[[], AsyncIterable[tuple[str, bytes, dict[str, str]]]]) -> int:
        """One atomic batch of `messages()` (see `_publish_batch`). A batch refused for want of responders
        or cut off by a lost connection before its commit stored nothing: while a clustered stream elects
        a new leader (or the connection is replaced) it is sent again, from `messages()` anew and under a
        new batch id, for up to `FAILOVER_S`. An unanswered commit (`OutcomeUnknown`) is the caller's to
        settle."""
        self.calls["publish_batch"] += 1
        deadline: float | None = None
        attempt = 0
        while True:
            attempt += 1
            first_subject: list[str] = []
            batch = _noting_first_subject(messages(), first_subject)
            try:
                return await self._publish_batch(batch_id if attempt == 1 else f"{batch_id}.r{attempt}", batch)
            except OutcomeUnknown:
                raise
            except (NotFound, Unavailable) as e:
                if not first_subject:
                    raise
                if deadline is None:
                    deadline = trio.current_time() + FAILOVER_S
                log.debug("batch %s cut off before its commit (%s); sending it again", batch_id, e)
                await self._await_leader(first_subject[0], deadline)

    async def _publish_batch(self, batch_id: str, msgs: AsyncIterable[tuple[str, bytes, dict[str, str]]]) -> int:
        """One atomic batch, as nats-server 2.12+ takes it (verified on 2.15): the first message must be
        a request; the server answers every message sent with a reply subject with an empty message
        (or a refusal such as "atomic publish is disabled"), and the commit, on the last, with the only
        real ack: `{"stream", "seq": <last>, "batch", "count"}`. Every message is sent as a request, in
        order: the server stores a batch only at the commit, which costs far more than these round trips
        (measured: no slower than plain publishes in between), and a refusal shows at once. A refusal
        of the commit (wrong last subject sequence, a `Nats-Msg-Id` the stream saw within its duplicate
        window, a missing message, limits) drops the whole batch."""
        timeout = self.bridge.request_timeout
        sent_bytes = 0
        count = 0
        held: tuple[str, bytes, dict[str, str]] | None = None

        async def send(msg: tuple[str, bytes, dict[str, str]], commit: bool) -> int:
            subject, data, headers = msg
            headers = dict(headers, **{BATCH_ID: batch_id, BATCH_SEQUENCE: str(count)})
            if commit:
                headers[BATCH_COMMIT] = "1"
                # The server stores the whole batch when the commit arrives: allow for the bytes.
                try:
                    reply = await self.bridge.request(subject, data, headers,
                                                      timeout=timeout + sent_bytes / _BATCH_COMMIT_RATE)
                except Unavailable as e:
                    raise OutcomeUnknown(f"commit of batch {batch_id}: no ack ({e})") from None
            else:
                reply = await self.bridge.request(subject, data, headers)
                if not reply.data:
                    return 0
            return _batch_ack(reply.data, subject)

        async for msg in msgs:
            if held is not None:
                self.calls["batch_msgs"] += 1
                await send(held, False)
            count += 1
            sent_bytes += len(msg[1])
            held = msg
        if held is None:
            raise InvalidArgument(f"batch {batch_id} is empty")
        self.calls["batch_msgs"] += 1
        return await send(held, True)

    async def purge_subject(self, stream: str, subject: str, *, before_seq: int = 0) -> None:
        self.calls["purge_subject"] += 1
        check_purge_filter(subject)
        body: dict[str, Any] = {"filter": subject}
        if before_seq:
            body["seq"] = before_seq
        await self._api(f"STREAM.PURGE.{stream}", body)

    async def last_msg(self, stream: str, subject: str) -> StoredMsg | None:
        """The last message on `subject`, from the stream's leader (`STREAM.MSG.GET`), not a direct get:
        what this answers decides conflicts and settles publishes, and a replica may not have applied
        the latest write yet (on a replicated stream even `min_last_seq` was seen to let a stale meta
        through right after a rewrite of it)."""
        self.calls["last_msg"] += 1
        msg = await self._msg_get(stream, {"last_by_subj": subject}, subject)
        if msg is not None:
            self._observe({"stream": stream, "seq": msg.seq})
        return msg

    async def _msg_get(self, stream: str, body: dict[str, Any], subject: str) -> StoredMsg | None:
        """One `STREAM.MSG.GET` (answered by the stream's leader): the message, or None when there is
        none. Its `pending` is -1: this API does not count the messages after it."""
        try:
            reply = await _api(self.bridge, f"STREAM.MSG.GET.{stream}", body)
        except JetStreamAPIError as e:
            if e.err_code == ERR_NO_MESSAGE_FOUND:
                return None
            if e.err_code == ERR_STREAM_NOT_FOUND or e.code == 404:
                raise NotFound(f"no stream {stream}") from None
            raise
        m = reply.get("message") or {}
        try:
            headers = _parse_header_block(base64.b64decode(m["hdrs"])) if m.get("hdrs") else {}
            kept = {k: v for k, v in headers.items()
                    if not k.startswith("Nats-") or k in ("Nats-Rollup", "Nats-Msg-Id")} or None
            when = m.get("time")
            return StoredMsg(int(m["seq"]), str(m.get("subject", subject)), kept,
                             base64.b64decode(m.get("data") or ""), parse_rfc3339_ns(when) if when else 0)
        except (KeyError, TypeError, ValueError) as e:
            raise Unavailable(f"unreadable reply to STREAM.MSG.GET {stream} {body}: {e!r}") from None

    async def get_batch(self, stream: str, subject: str, start_seq: int, batch: int,
                        max_bytes: int) -> list[StoredMsg]:
        self.calls["get_batch"] += 1
        max_bytes = min(max_bytes, self.bridge.max_batch_bytes)  # replies in flight stay within the budget
        if not self._reads_direct(stream):
            return await _MsgGets(self, stream, subject, start_seq, batch, max_bytes).all()
        body = {"seq": max(start_seq, 1), "next_by_subj": subject, "batch": batch, "max_bytes": max_bytes}
        for _ in range(_FLOOR_TRIES):
            floored = self._floor_body(stream, body)
            try:
                replies = await self.bridge.request_many(f"$JS.API.DIRECT.GET.{stream}", _asking(floored),
                                                         max_bytes=max_bytes)
            except NotPermitted as e:
                self._direct_not_permitted(stream, e)
                return await _MsgGets(self, stream, subject, start_seq, batch, max_bytes).all()
            if floored is body or not replies or replies[0].status != "412":
                break
            await self._floor_refused(stream)
        if replies and replies[0].status == "503":
            why = await self._why_no_responders(stream)
            if why == _NO_DIRECT:
                return await _MsgGets(self, stream, subject, start_seq, batch, max_bytes).all()
            if why == _GONE:
                return []
        out: list[StoredMsg] = []
        for m in replies:
            if m.headers and "Nats-Sequence" in m.headers:
                out.append(_direct_msg(m, full=False))
            elif m.status in ("404", "408"):
                break
            else:
                raise Unavailable(f"direct get batch {stream} {subject}: status {m.status}")
        return out

    async def stream_batch(self, stream: str, subject: str, start_seq: int, batch: int,
                           max_bytes: int) -> BatchStream | _MsgGets:
        """Like `get_batch`, but hands messages over as they arrive instead of all at the end."""
        self.calls["stream_batch"] += 1
        max_bytes = min(max_bytes, self.bridge.max_batch_bytes)  # replies in flight stay within the budget
        if not self._reads_direct(stream):
            return _MsgGets(self, stream, subject, start_seq, batch, max_bytes)
        body = self._floor_body(stream, {"seq": max(start_seq, 1), "next_by_subj": subject, "batch": batch,
                                         "max_bytes": max_bytes})
        sub = await self.bridge.request_stream(f"$JS.API.DIRECT.GET.{stream}", _asking(body), max_bytes=max_bytes)

        async def without_direct() -> _MsgGets | None:
            why = await self._why_no_responders(stream)
            if why == _GONE:
                return _MsgGets(self, stream, subject, start_seq, 0, max_bytes)  # (asks nothing: no messages)
            if why != _NO_DIRECT:
                return None
            return _MsgGets(self, stream, subject, start_seq, batch, max_bytes)

        def not_permitted(e: NotPermitted) -> _MsgGets:
            self._direct_not_permitted(stream, e)
            return _MsgGets(self, stream, subject, start_seq, batch, max_bytes)

        return BatchStream(sub, self.bridge.request_timeout, f"{stream} {subject}",
                           on_floor_refused=lambda: self._floor_refused(stream),  # the caller asks again
                           on_no_responders=without_direct, on_not_permitted=not_permitted)

    async def subject_index(self, stream: str, subject: str) -> list[tuple[int, int]]:
        """(sequence, payload size) of every message on `subject`, without fetching payloads: over the
        lean connection (`_lean_index`) when there is one; on any doubt about what that delivered, or
        when it cannot be made (no such connection, lost, refused), by the ordered consumer over the
        main connection, as without one."""
        self.calls["subject_index"] += 1
        if self.bridge.reads_in_trio and not self._lean_scans_refused:
            try:
                return await self._lean_index(stream, subject)
            except _ScanDoubt as e:
                log.info("scan of %s over the lean connection: %s; scanning again over the main one", subject, e)
            except NotPermitted as e:
                # (The user may not subscribe there, or create consumers: not worth asking every time.)
                self._lean_scans_refused = True
                log.info("scans go over the main connection from now on: %s", e)
            except NatsFSError as e:
                log.debug("scan of %s over the lean connection: %s; scanning over the main one", subject, e)
        return await self._ordered_index(stream, subject)

    async def _lean_index(self, stream: str, subject: str) -> list[tuple[int, int]]:
        """`subject_index` by `_lean_scan` (each delivery on `subject`, with a size)."""
        rows, _ = await self._lean_scan(stream, subject, sizes=True)
        return [(seq, size) for _, seq, size in rows if size is not None]

    async def _lean_scan(self, stream: str, filter_subject: str, *, sizes: bool = False, last_seq: int = 0
                         ) -> tuple[list[tuple[bytes, int, int | None]], bool]:
        """(subject, sequence, `Nats-Msg-Size`) of every message on `filter_subject`, by a one-shot
        headers-only pull consumer whose deliveries go to the trio thread's lean connection
        (`Bridge.open_deliveries`), no acks, deleted at the end; its pull requests are byte-bounded
        (`_take_deliveries`), and whether it is complete (see there). Proven as the ordered consumer's
        scan is; `_ScanDoubt` for anything else, `Unavailable` when the connection is lost before the
        last delivery came."""
        self.calls["lean_scans"] += 1
        deliveries = self.bridge.open_deliveries()
        name = ""
        try:
            config: dict[str, Any] = {
                "filter_subject": filter_subject,
                "deliver_policy": "all",
                "ack_policy": "none",  # (a pull consumer may have none on a limits stream, as buckets are)
                "replay_policy": "instant",
                "headers_only": True,
                "mem_storage": True,
                "num_replicas": 1,
                "inactive_threshold": int(30e9),  # (deleted below; this if that is lost)
            }
            info = await _api(self.bridge, f"CONSUMER.CREATE.{stream}", {"stream_name": stream, "config": config})
            name = str(info.get("name") or "")
            if not name:
                raise _ScanDoubt(f"consumer of {stream} created without a name")
            if int(info.get("num_pending", -1)) == 0:
                return [], True  # (nothing on the subject)
            return await _take_deliveries(deliveries, stream, name, filter_subject, self.bridge.request_timeout,
                                          sizes=sizes, last_seq=last_seq)
        finally:
            deliveries.close()
            if name:
                with trio.CancelScope(shield=True), trio.move_on_after(2), contextlib.suppress(NatsFSError):
                    await _api(self.bridge, f"CONSUMER.DELETE.{stream}.{name}")

    async def _ordered_scan(self, stream: str, filter_subject: str, *, last_seq: int
                            ) -> tuple[list[tuple[bytes, int, int | None]], bool]:
        """`_lean_scan` (without sizes) by an ordered consumer over the main connection, which catches up
        by byte-bounded pull requests (`_ConsumerStream`), re-created on gaps, stalls and reconnects."""
        self.calls["ordered_scans"] += 1
        scan = _ConsumerStream(self.bridge, stream, filter_subject, deliver_policy="all", headers_only=True,
                               pulls_refused=self._pulls_refused)
        await scan.start()
        self._watches.add(scan)
        out: list[tuple[bytes, int, int | None]] = []
        chase = _Chase(last_seq)
        try:
            while not scan.caught_up:
                batch = await scan.next_batch(timeout=self.bridge.request_timeout)
                if batch.reset:
                    out.clear()
                    chase = _Chase(last_seq)
                for m in batch.msgs:
                    out.append((m.subject.encode(errors="surrogateescape"), m.seq, None))
                    if chase.beyond(m.seq):
                        return out, False
                if batch.caught_up:
                    break
                if not batch.msgs and scan.idle_for() > self.bridge.request_timeout:
                    raise Unavailable(f"scan of {filter_subject} got no messages")
        finally:
            await scan.close()
        return out, True

    async def _ordered_index(self, stream: str, subject: str) -> list[tuple[int, int]]:
        """`subject_index` by an ordered consumer over the main connection (re-created on gaps, stalls
        and reconnects)."""
        scan = _ConsumerStream(self.bridge, stream, subject, deliver_policy="all", headers_only=True,
                               pulls_refused=self._pulls_refused)
        await scan.start()
        self._watches.add(scan)
        out: list[tuple[int, int]] = []
        try:
            while not scan.caught_up:
                batch = await scan.next_batch(timeout=self.bridge.request_timeout)
                if batch.reset:
                    out.clear()
                for m in batch.msgs:
                    size = (m.headers or {}).get("Nats-Msg-Size")
                    if m.subject != subject or size is None:
                        raise Unavailable(f"scan of {subject}: unexpected delivery {m.subject} seq {m.seq}")
                    out.append((m.seq, int(size)))
                if batch.caught_up:
                    break
                if not batch.msgs and scan.idle_for() > self.bridge.request_timeout:
                    raise Unavailable(f"scan of {subject} got no messages")
        finally:
            await scan.close()
        return out

    async def sequences(self, stream: str, start_seq: int, stop_seq: int) -> list[int]:
        """The sequences in [start_seq, stop_seq) that hold a message (any subject), without payloads."""
        if stop_seq <= start_seq:
            return []
        scan = _ConsumerStream(self.bridge, stream, "", deliver_policy="by_start_sequence", headers_only=True,
                               start_seq=start_seq, pulls_refused=self._pulls_refused)
        await scan.start()
        out: list[int] = []
        try:
            while not scan.caught_up:
                batch = await scan.next_batch(timeout=self.bridge.request_timeout)
                if batch.reset:
                    out.clear()
                out.extend(m.seq for m in batch.msgs if m.seq < stop_seq)
                if batch.caught_up or (batch.msgs and batch.msgs[-1].seq >= stop_seq - 1):
                    break
                if not batch.msgs and scan.idle_for() > self.bridge.request_timeout:
                    raise Unavailable(f"scan of {stream} from {start_seq} got no messages")
        finally:
            await scan.close()
        return out

    async def stream_updates(self) -> _StreamUpdates:
        """The server's advisories of stream config updates (a plain subscription, restored on every new
        connection; where the account may not subscribe to them, none arrive)."""
        self.calls["stream_updates"] += 1
        return _StreamUpdates(await self.bridge.subscribe(STREAM_UPDATED_ADVISORY + "*"))

    async def watch(self, stream: str, filter_subject: str, *, last_per_subject: bool = True) -> _ConsumerStream:
        w = _ConsumerStream(self.bridge, stream, filter_subject,
                            deliver_policy="last_per_subject" if last_per_subject else "all", floors=self.floors,
                            pulls_refused=self._pulls_refused)
        await w.start(stream_created_ns=(await self.stream_info(stream)).created_ns)
        self._watches.add(w)
        return w


class _ScanDoubt(Unavailable):
    """A scan's deliveries did not prove what it returns (the caller scans again another way)."""


class _Chase:
    """When a scan begun once its stream ended at `last_seq` gives up chasing what other clients store
    meanwhile: once it delivered as many messages after `last_seq` as before it, and 1000 more (never
    without a `last_seq`)."""

    def __init__(self, last_seq: int) -> None:
        self.last_seq = last_seq
        self.before = self.after = 0

    def beyond(self, seq: int) -> bool:
        if not self.last_seq:
            return False
        if seq <= self.last_seq:
            self.before += 1
            return False
        self.after += 1
        return self.after > self.before + 1000


def _subject_test(filter_subject: str) -> Callable[[bytes], bool]:
    """Whether a delivery's subject matches `filter_subject` (NATS matching: `*` one token, `>` the rest)."""
    want = filter_subject.encode()
    tokens = want.split(b".")
    if b"*" not in tokens and b">" not in tokens:
        return want.__eq__
    if b"*" not in tokens and tokens[-1] == b">":
        prefix = want[:-1]
        return lambda s: s.startswith(prefix) and len(s) > len(prefix)

    def test(s: bytes) -> bool:
        got = s.split(b".")
        for i, tok in enumerate(tokens):
            if tok == b">":
                return len(got) > i
            if i >= len(got) or (tok != b"*" and tok != got[i]):
                return False
        return len(got) == len(tokens)

    return test


async def _take_deliveries(deliveries: Deliveries, stream: str, consumer: str, subject: str, timeout: float,
                           *, sizes: bool = True, last_seq: int = 0
                           ) -> tuple[list[tuple[bytes, int, int | None]], bool]:
    """What `_lean_scan` proves of the deliveries of its pull consumer (`deliver_policy` all): (subject,
    stream sequence, `Nats-Msg-Size`) of each, in order, up to the one that leaves nothing pending
    (complete), or the one past `last_seq` where it gives up chasing other clients' writes (`_Chase`:
    not complete). Each must be the next one of this consumer (its reply subject, `_ack_pattern`: this
    stream and consumer, consumer sequences 1, 2, 3... without a gap, stream sequences rising), on a
    subject `subject` matches, with a size if `sizes`; `_ScanDoubt` otherwise. `Unavailable` when
    nothing came for `timeout` s or the connection was lost before the last one. (A few microseconds
    a delivery: thousands come for a large object.)

    The deliveries are pulled: requests of `SCAN_REQUEST_BYTES` each (`max_bytes`), and a new one only
    once what is asked for and not yet delivered is at most `SCAN_REQUESTS - 1` requests' worth, so the
    server never holds more than `SCAN_REQUESTS` of them for this scan, however slowly it is read.
    (The first one alone until the server answered: a refused request is refused once.)
    The bytes are counted as the server counts them (subject, reply subject, header block and payload
    of each delivery); a request ends when its bytes are used up to the last one (silently), or with a
    status that says what it left unused (`Nats-Pending-Bytes`: "409 Message Size Exceeds MaxBytes"
    when the next delivery does not fit in what it has left, "409 Batch Completed", "408 Request
    Timeout"). A request that ends with all of its bytes unused met a delivery larger than a whole
    request (a chunk message with headers of over 256 KiB): `_ScanDoubt`, as is any other status but a
    heartbeat (the consumer deleted, a leader change, a limit of the server's)."""
    matches = _subject_test(subject)
    ack = _ack_pattern(stream, consumer)
    ask = json.dumps({"batch": SCAN_REQUEST_BYTES // 64, "max_bytes": SCAN_REQUEST_BYTES}).encode()
    pull = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
    asked = 0  # bytes asked for and not yet delivered (or given up by their request)
    out: list[tuple[bytes, int, int | None]] = []
    chase = _Chase(last_seq)
    last = 0  # the stream sequence of the last delivery
    cseq = 0
    requests = 1
    while True:
        while asked <= (requests - 1) * SCAN_REQUEST_BYTES:
            deliveries.request(pull, ask)
            asked += SCAN_REQUEST_BYTES
        rows, statuses = await deliveries.next(timeout)
        if not rows and not statuses:
            raise Unavailable(f"scan of {subject}: no deliveries for {timeout:g}s")
        requests = SCAN_REQUESTS
        for delivered_subject, reply, size, nbytes in rows:
            m = ack.fullmatch(reply)
            if m is None:
                raise _ScanDoubt(f"a delivery with the reply subject {reply!r}")
            sseq, delivered = int(m[1] or m[4]), int(m[2] or m[5])
            if delivered != cseq + 1:
                raise _ScanDoubt(f"consumer sequence {delivered} after {cseq}")
            if sseq <= last:
                raise _ScanDoubt(f"stream sequence {sseq} after {last}")
            if not matches(delivered_subject) or (sizes and size is None):
                raise _ScanDoubt(f"unexpected delivery {delivered_subject!r} seq {sseq}")
            cseq, last = delivered, sseq
            out.append((delivered_subject, sseq, size))
            if (m[3] or m[6]) == b"0":  # nothing pending after it
                return out, True
            if chase.beyond(sseq):
                return out, False
            asked -= len(delivered_subject) + len(reply) + nbytes
        for code, description, headers in statuses:
            if code == "100":
                continue  # (a heartbeat)
            unused = headers.get("Nats-Pending-Bytes", "")
            if code not in ("408", "409") or not unused.isdigit():
                raise _ScanDoubt(f"status {code} {description}".rstrip())
            if int(unused) >= SCAN_REQUEST_BYTES:
                raise _ScanDoubt(f"a delivery larger than a whole request ({code} {description})")
            asked -= int(unused)
        if asked < 0:  # (never: the server's count and this one differ)
            raise _ScanDoubt(f"{-asked} bytes delivered beyond what was asked for")


def _ack_pattern(stream: str, consumer: str) -> re.Pattern[bytes]:
    """The reply subject of a delivery of `consumer` of `stream`: `$JS.ACK.<stream>.<consumer>.<delivered>.
    <stream seq>.<consumer seq>.<ts>.<pending>`, or with a domain and an account hash before the
    stream and a token after it; groups (stream seq, consumer seq, pending) of the one form or the
    other (1-3 or 4-6). Numbers as the server writes them: digits, no sign, no leading zero."""
    name = re.escape(stream.encode()) + rb"\." + re.escape(consumer.encode())
    n = rb"(?:0|[1-9][0-9]{0,19})"
    tail = rb"\." + n + rb"\.(" + n + rb")\.(" + n + rb")\." + n + rb"\.(" + n + rb")"
    return re.compile(rb"\$JS\.ACK\.(?:" + name + tail + rb"|[^.]+\.[^.]+\." + name + tail + rb"\.[^.]+)")


class BatchStream:
    """The replies of one batched direct get, in arrival order; `next()` is None after the last. A first
    reply of "no responders" asks `on_no_responders` for the same batch by other means (a stream without
    direct gets: `_MsgGets`), which then answers instead; so does a request the server refused the user
    (`on_not_permitted`: a user without direct-get permission)."""

    def __init__(self, sub: Subscription, timeout: float, what: str,
                 on_floor_refused: Callable[[], Awaitable[None]] | None = None,
                 on_no_responders: Callable[[], Awaitable[_MsgGets | None]] | None = None,
                 on_not_permitted: Callable[[NotPermitted], _MsgGets] | None = None) -> None:
        self._sub = sub
        self._timeout = timeout
        self._what = what
        self._on_floor_refused = on_floor_refused
        self._on_no_responders = on_no_responders
        self._on_not_permitted = on_not_permitted
        self._instead: _MsgGets | None = None
        self._answered = False
        self.done = False

    async def next(self) -> list[StoredMsg] | None:
        if self._instead is not None:
            return await self._instead.next()
        if self.done:
            return None
        try:
            msgs = await self._sub.next_batch(self._timeout)
        except NotPermitted as e:  # (refused before any reply: the server sent none)
            await self.close()
            if self._answered or self._on_not_permitted is None:
                raise
            self._instead = self._on_not_permitted(e)
            return await self._instead.next()
        if not msgs:
            await self.close()
            raise Unavailable(f"direct get batch {self._what}: no reply in {self._timeout:g}s")
        out: list[StoredMsg] = []
        for m in msgs:
            if m.headers and "Nats-Sequence" in m.headers:
                out.append(_direct_msg(m, full=False))
                continue
            self.done = True
            await self.close()
            if m.status == "412" and self._on_floor_refused is not None:
                await self._on_floor_refused()
            if m.status == "503" and not self._answered and not out and self._on_no_responders is not None:
                self._instead = await self._on_no_responders()
                if self._instead is not None:
                    return await self._instead.next()
            if m.status not in ("204", "404", "408"):
                raise Unavailable(f"direct get batch {self._what}: status {m.status}")
            break
        self._answered = True
        return out

    async def close(self) -> None:
        self.done = True
        await self._sub.unsubscribe()
        if self._instead is not None:
            await self._instead.close()


class _MsgGets:
    """A batched get made of `STREAM.MSG.GET` requests, for a stream that does not allow direct gets:
    the messages on `subject` from `start_seq` on, at most `batch` of them, stopping once `max_bytes` is
    reached, as a batched direct get returns them. Each `next()` asks for up to `MSG_GET_PARALLEL`
    consecutive sequences at once ("the first message on the subject at or after s") and chains the
    replies: the message after one at sequence q is the reply for q+1. Chunks stored one after another
    (one writer) come one per request; interleaved messages of other subjects only cost requests.
    Nothing here is trusted beyond what the reply says (subject, sequence, bytes): the chunk cache
    checks every message as it checks a direct get's."""

    def __init__(self, js: JetStreams, stream: str, subject: str, start_seq: int, batch: int,
                 max_bytes: int) -> None:
        self._js = js
        self._stream = stream
        self._subject = subject
        self._seq = max(start_seq, 1)
        self._left = batch
        self._max_bytes = max_bytes  # 0: no limit, as for a direct get
        self._bytes_left = max_bytes
        self.done = batch <= 0

    async def next(self) -> list[StoredMsg] | None:
        if self.done:
            return None
        js, stream, subject = self._js, self._stream, self._subject
        asked = list(range(self._seq, self._seq + min(self._left, MSG_GET_PARALLEL)))
        replies: dict[int, StoredMsg | None] = {}

        async def get(seq: int) -> None:
            replies[seq] = await js._msg_get(stream, {"seq": seq, "next_by_subj": subject}, subject)

        js.calls["msg_get"] += len(asked)
        with single_errors():  # a failed request surfaces as itself (its errno), not as a group
            async with trio.open_nursery() as nursery:
                for seq in asked:
                    nursery.start_soon(get, seq)
        out: list[StoredMsg] = []
        while self._seq in replies:
            m = replies[self._seq]
            if m is None:  # nothing on the subject from here on
                self.done = True
                break
            if m.seq < self._seq:
                raise Unavailable(f"STREAM.MSG.GET {stream} {subject} from seq {self._seq} answered seq {m.seq}")
            out.append(m)
            self._seq = m.seq + 1
            self._left -= 1
            self._bytes_left -= len(m.data)
            if self._left <= 0 or (self._max_bytes > 0 and self._bytes_left <= 0):
                self.done = True
                break
        return out

    async def all(self) -> list[StoredMsg]:
        out: list[StoredMsg] = []
        while (msgs := await self.next()) is not None:
            out += msgs
        return out

    async def close(self) -> None:
        self.done = True


def _parse_header_block(raw: bytes) -> dict[str, str]:
    """`NATS/1.0\r\nKey: Value\r\n...` as a dict (the first value of a repeated key)."""
    out: dict[str, str] = {}
    for line in raw.decode(errors="replace").split("\r\n")[1:]:
        key, sep, value = line.partition(":")
        if sep and key.strip() and key.strip() not in out:
            out[key.strip()] = value.strip()
    return out


def _asking(body: dict[str, Any]) -> Callable[[int], bytes]:
    """A direct get batch request for the bridge, which says how many bytes it may ask for once its
    reply budget is granted (fewer than `body` says when the budget shrank meanwhile)."""
    return lambda max_bytes: json.dumps({**body, "max_bytes": max_bytes}).encode()


def _direct_msg(m: Msg, *, full: bool = True) -> StoredMsg:
    """A direct-get reply as a stored message; `full=False` (chunks in bulk) skips the timestamp and
    headers, which nobody reads for chunks and which cost real time per 128 KiB. The subject, sequence
    and pending count are always kept: they are what proves which chunk a reply is."""
    h = m.headers or {}
    if not full:
        return StoredMsg(int(h["Nats-Sequence"]), h.get("Nats-Subject", ""), None, m.data, 0,
                         int(h.get("Nats-Num-Pending", -1)))
    ts = h.get("Nats-Time-Stamp")
    headers = {k: v for k, v in h.items() if not k.startswith("Nats-") or k in ("Nats-Rollup",)} or None
    return StoredMsg(int(h["Nats-Sequence"]), h.get("Nats-Subject", ""), headers, m.data,
                     parse_rfc3339_ns(ts) if ts else 0, int(h.get("Nats-Num-Pending", -1)))


class _ConsumerStream:
    """An ordered consumer: delivers every message in order, re-created on gaps and stalls.

    After a re-creation it resumes at the stream sequence after the last one delivered, so the
    consumer of this stream never sees a message twice or misses one. When resuming is not sound
    (the stream was deleted and created again, or lost the messages after the last one delivered, as
    a server restarted with a memory store does) it starts over from the beginning and the next batch
    says `reset`. Server and connection trouble never escapes `next_batch`: it is logged and retried
    with a backoff while the batches come back empty; only a stream that is gone raises `NotFound`.

    Each consumer catches up by pulling (`_ask`): a pull consumer (no acks) whose deliveries come to a
    subscription of its own, asked for in requests of `CATCHUP_REQUEST_BYTES`, a new one only once what
    is asked for and not yet read from the socket is at most `CATCHUP_REQUESTS - 1` requests' worth
    (the bytes counted as the server counts them, `Subscription.received_bytes`). So however slowly
    the daemon reads (a starved process, a bucket of 100 000 metas at mount), the server never holds
    more than that for it, far below a small `max_pending`; a push consumer's flow-control window
    grows to 32 MiB. Once a delivery leaves nothing pending (or there was nothing to deliver) the
    next `next_batch` replaces it with the live push consumer from the sequence after the last
    delivery taken: a hand-over like any resume, by stream sequence. The ordered scans end before
    that. A user the server refuses pull requests (`pulls_refused`, per stream) catches up by push.
    """

    def __init__(self, bridge: Bridge, stream: str, filter_subject: str, *, deliver_policy: str,
                 headers_only: bool = False, start_seq: int = 0, floors: dict[str, int] | None = None,
                 pulls_refused: set[str] | None = None):
        self.bridge = bridge
        self.floors = floors  # raised to every sequence delivered (see JetStreams.floors)
        self.stream = stream
        self.filter_subject = filter_subject
        self.deliver_policy = deliver_policy
        self.headers_only = headers_only
        self.start_seq = start_seq  # with deliver_policy "by_start_sequence"
        self.caught_up = False
        self._caught_up_reported = False
        self.resets = 0
        self._sub: Subscription | None = None
        self._consumer: str | None = None
        self._cseq = 0
        self._last_sseq = 0
        self._stream_created_ns = 0
        self._last_activity = time.monotonic()
        self._pending_reset = False
        self._stale = False  # re-create before waiting again (the connection was re-established)
        self._backoff = Backoff(1.0, 5.0, clock=time.monotonic)  # re-creating the consumer
        self._failure_said = False  # a failed re-creation of this streak was said at WARNING
        self._retry_at = 0.0
        self._closed = False
        self._pulls_refused = pulls_refused if pulls_refused is not None else set()
        self._pulling = False  # the consumer is a pull consumer catching up
        self._handover = False  # ... that caught up: the live push consumer is made at the next call
        self._asked = 0  # bytes its requests asked for (less those they left unused)
        self._answered = False  # the server answered one of its requests
        self._request_bytes = CATCHUP_REQUEST_BYTES

    def idle_for(self) -> float:
        return time.monotonic() - self._last_activity


    def mark_stale(self) -> None:
        """The connection was re-established: the consumer may be gone with the server; re-create it."""
        self._stale = True
        if self._sub is not None:
            self._sub.interrupt()

    async def start(self, *, stream_created_ns: int = 0) -> None:
        """Create the consumer; `stream_created_ns` (the stream's creation time) lets a later resume
        notice that the stream was deleted and created again in between."""
        self._stream_created_ns = stream_created_ns
        await self._create(resume=False)

    async def _resume_is_sound(self) -> bool:
        """Whether the stream still holds everything after the last message delivered."""
        st = await _stream_info(self.bridge, self.stream)
        why = ""
        if self._stream_created_ns and st.created_ns and st.created_ns != self._stream_created_ns:
            why = "the stream was created again"
        elif st.last_seq < self._last_sseq:
            why = f"the stream ends at {st.last_seq}, before {self._last_sseq} which was delivered"
        elif st.messages and st.first_seq > self._last_sseq + 1:
            why = f"the stream lost messages {self._last_sseq + 1}..{st.first_seq - 1}"
        if st.created_ns:
            self._stream_created_ns = st.created_ns
        if why:
            log.warning("watch %s: %s; starting over", self.filter_subject, why)
            return False
        return True

    async def _create(self, *, resume: bool, pull: bool = True) -> None:
        pull = pull and self.stream not in self._pulls_refused
        if self._sub is not None:
            await self._drop()
        if resume and self._last_sseq and not await self._resume_is_sound():
            resume = False
            self._last_sseq = 0
            self._pending_reset = True
            self.caught_up = False
            self.resets += 1
        inbox = self.bridge.new_inbox()
        self._sub = await self.bridge.subscribe(inbox, paced=not pull, pulled=pull)
        config: dict[str, Any] = {
            "filter_subject": self.filter_subject,
            "ack_policy": "none",  # (a pull consumer may have none on a limits stream, as buckets are)
            "replay_policy": "instant",
            "mem_storage": True,
            "num_replicas": 1,
            "inactive_threshold": int(30e9),
        }
        if not pull:
            config.update({"deliver_subject": inbox, "flow_control": True, "idle_heartbeat": int(HEARTBEAT_S * 1e9)})
        if self.headers_only:
            config["headers_only"] = True
        if resume and self._last_sseq:
            config["deliver_policy"] = "by_start_sequence"
            config["opt_start_seq"] = self._last_sseq + 1
        else:
            config["deliver_policy"] = self.deliver_policy
            if pull and self.deliver_policy == "last_per_subject":
                # (A pull consumer delivering the last message per subject loses one each time a request
                # ends for a message that does not fit in what it has left, nats-server 2.15: 229 of
                # 3000 metas never came. Every message of the subjects instead, in order, as a resumed
                # consumer delivers them anyway: the last one of each subject is applied last. An
                # Object Store subject holds one meta, published with rollup; a client that writes
                # metas without it has its older ones applied first.)
                config["deliver_policy"] = "all"
            if self.deliver_policy == "by_start_sequence":
                config["opt_start_seq"] = self.start_seq
        try:
            info = await _api(self.bridge, f"CONSUMER.CREATE.{self.stream}",
                              {"stream_name": self.stream, "config": config})
        except BaseException as e:
            sub, self._sub = self._sub, None
            with trio.CancelScope(shield=True):
                await sub.unsubscribe()
            if isinstance(e, JetStreamAPIError) and (e.err_code == ERR_STREAM_NOT_FOUND or e.code == 404):
                raise NotFound(f"no stream {self.stream}") from None
            raise
        self._consumer = info["name"]
        self._cseq = 0
        self._last_activity = time.monotonic()
        self._pulling, self._handover = pull, False
        self._asked, self._answered, self._request_bytes = 0, False, CATCHUP_REQUEST_BYTES
        if int(info.get("num_pending", 0)) == 0 and not (resume and self._last_sseq):
            self.caught_up = True
        if pull and int(info.get("num_pending", 0)) == 0:
            self.caught_up = True  # (everything up to now was delivered, resumed or not)
            self._handover = True

    async def _ask(self) -> None:
        """Pull requests, byte-bounded (see the class): a new one only while what is asked for and not
        yet read is at most `CATCHUP_REQUESTS - 1` requests' worth; the first one alone until the server
        answered (a refused request is refused once), and so is one for a delivery larger than a
        request (`_request_ended`)."""
        sub = self._sub
        assert sub is not None
        one = self._request_bytes
        ahead = (CATCHUP_REQUESTS - 1) * one if self._answered and one == CATCHUP_REQUEST_BYTES else 0
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self._consumer}"
        if self._asked < sub.received_bytes:  # (never: the server's count and this one differ)
            log.debug("watch %s: %d bytes read beyond what was asked for", self.filter_subject,
                      sub.received_bytes - self._asked)
            self._asked = sub.received_bytes
        while self._asked - sub.received_bytes <= ahead:
            await sub.pull(subject, json.dumps({"batch": max(one // 64, 1), "max_bytes": one}).encode())
            self._asked += one

    async def _pulled_everything(self) -> bool:
        """A pull consumer that delivered nothing for `STALL_S`: True when the server says it has nothing
        pending and delivered nothing more than was taken (so it caught up); False (a stall, or no
        answer) otherwise."""
        try:
            info = await _api(self.bridge, f"CONSUMER.INFO.{self.stream}.{self._consumer}")
        except NatsFSError:
            return False
        delivered = info.get("delivered") or {}
        return int(info.get("num_pending", -1)) == 0 and int(delivered.get("consumer_seq", -1)) == self._cseq

    def _request_ended(self, m: Msg) -> bool:
        """A pull request's status: True for the end of a request ("408 Request Timeout", "409 Message
        Size Exceeds MaxBytes" / "Batch Completed", with the bytes it left unused, given back here). A
        request that ends with all of its bytes unused met a delivery larger than a request: the next
        one asks for the largest message the server takes, alone. False for anything else (the consumer
        deleted, a leader change, no responders): the caller re-creates the consumer."""
        headers = m.headers or {}
        unused = headers.get("Nats-Pending-Bytes", "")
        if m.status not in ("408", "409") or not unused.isdigit():
            return False
        self._asked -= int(unused)
        self._answered = True
        if m.status == "409" and int(unused) >= self._request_bytes:
            self._request_bytes = max(self._request_bytes, self.bridge.max_payload + 64 * 1024)
        return True

    async def _drop(self) -> None:
        sub, name = self._sub, self._consumer
        self._sub, self._consumer = None, None
        if sub is not None:
            await sub.unsubscribe()
        if name is not None:
            try:
                with trio.move_on_after(2):
                    await _api(self.bridge, f"CONSUMER.DELETE.{self.stream}.{name}")
            except NatsFSError:
                pass  # it expires by itself (inactive_threshold)

    async def close(self) -> None:
        self._closed = True
        with trio.CancelScope(shield=True):
            await self._drop()

    async def recreate(self, *, pull: bool = True) -> None:
        """Resume from the last delivered sequence with a fresh consumer (after a gap, stall or reconnect;
        `pull` False: the live push consumer, once caught up)."""
        await self._create(resume=bool(self._last_sseq), pull=pull)

    async def _try_recreate(self, why: str, *, pull: bool = True) -> bool:
        """Re-create the consumer; False (logged, retried later with a backoff) when the server is not
        answering. `NotFound` (the stream is gone) is raised."""
        try:
            await self.recreate(pull=pull)
        except NotFound:
            raise
        except NatsFSError as e:
            # Without a connection the bridge has said so once (`lost the connection to NATS`): a line per
            # watch (one per bucket) would repeat that one outage many times over.
            outage = isinstance(e, NoConnection) or not self.bridge.connected
            said = not self._backoff.failures and not outage
            self._failure_said = self._failure_said or said
            log.log(logging.WARNING if said else logging.DEBUG,
                    "watch %s: could not re-create the consumer (%s): %s; retrying", self.filter_subject, why, e)
            self._retry_at = time.monotonic() + self._backoff.next_pause()
            self._last_activity = time.monotonic()
            return False
        if self._backoff.failures:
            log.log(logging.WARNING if self._failure_said else logging.DEBUG,
                    "watch %s: consumer re-created after %d failed attempts", self.filter_subject,
                    self._backoff.failures)
        self._backoff.reset()
        self._failure_said = False
        self._stale = False
        return True

    async def next_batch(self, timeout: float | None = None) -> WatchBatch:
        out = WatchBatch()
        wait = STALL_S if timeout is None else min(timeout, STALL_S)
        if self._closed:
            out.caught_up = self.caught_up
            return out
        if self._stale or self._sub is None:
            now = time.monotonic()
            if now < self._retry_at:
                await trio.sleep(min(self._retry_at - now, wait))
                out.caught_up = self.caught_up
                return out
            if not await self._try_recreate("reconnected" if self._stale else "no consumer"):
                out.caught_up = self.caught_up
                return out
        # Caught up by pulling, and said so: the live push consumer from the next sequence (a scan ends
        # before this).
        if self._handover and self._caught_up_reported and not await self._try_recreate("caught up", pull=False):
            out.caught_up = self.caught_up
            return out
        if self._pending_reset:
            self._pending_reset = False
            out.reset = True
        assert self._sub is not None
        if self.caught_up and not self._caught_up_reported:
            wait = 0  # an empty snapshot: say so at once instead of after a wait for messages
        if self._pulling and not self._handover:
            try:
                await self._ask()
            except Unavailable as e:  # (the connection is lost: the consumer is re-created on the next one)
                log.debug("watch %s: pull request not sent: %s", self.filter_subject, e)
        try:
            msgs = await self._sub.next_batch(wait)
        except NotPermitted as e:
            # (Only a pull request's refusal ends a subscription's batches so.)
            self._pulls_refused.add(self.stream)
            log.info("watch %s: the server refuses this user pull requests (%s); catching up by push instead",
                     self.filter_subject, e)
            await self._try_recreate("pull requests refused", pull=False)
            out.caught_up = self.caught_up and not self._pending_reset
            return out
        if msgs:
            self._last_activity = time.monotonic()
        for m in msgs:
            if m.status is not None:
                if self._pulling and m.status != "100":
                    if not self._request_ended(m):
                        log.info("watch %s: pull request answered %s %s; re-creating the consumer",
                                 self.filter_subject, m.status, (m.headers or {}).get("Description", ""))
                        await self._try_recreate("pull status")
                        out.caught_up = self.caught_up and not self._pending_reset
                        return out
                    continue
                if m.status == "100":
                    last_c = (m.headers or {}).get("Nats-Last-Consumer")
                    if last_c is not None and int(last_c) != self._cseq:
                        log.info("watch %s: heartbeat shows missed messages; re-creating consumer",
                                 self.filter_subject)
                        await self._try_recreate("missed messages")
                        out.caught_up = self.caught_up and not self._pending_reset
                        return out
                continue
            if not m.reply.startswith("$JS.ACK."):
                continue
            sseq, cseq, ts, pending = _parse_ack_reply(m.reply)
            if cseq != self._cseq + 1:
                log.info("watch %s: consumer sequence gap (%d after %d); re-creating", self.filter_subject,
                         cseq, self._cseq)
                await self._try_recreate("sequence gap")
                out.caught_up = self.caught_up and not self._pending_reset
                return out
            self._cseq = cseq
            self._last_sseq = sseq
            if self.floors is not None and sseq > self.floors.get(self.stream, 0):
                self.floors[self.stream] = sseq
            # (Nats-Msg-Size only comes with headers-only deliveries, where it is wanted.)
            out.msgs.append(StoredMsg(sseq, m.subject, m.headers or None, m.data, ts))
            if self._pulling:
                self._answered = True
                self._request_bytes = CATCHUP_REQUEST_BYTES
            if pending == 0:
                self.caught_up = True
                if self._pulling:
                    self._handover = True  # (what comes after it in this batch is taken too)
        if self.caught_up:
            out.caught_up = True
            self._caught_up_reported = True
        if (not msgs and not self._stale and self._pulling and not self._handover and self.idle_for() > HEARTBEAT_S
                and await self._pulled_everything()):
            # Messages it counted as pending were purged before it delivered them, the last one too (another
            # client purged a tombstone, say): no delivery said "nothing pending". Caught up, not stalled
            # (a pull consumer sends no heartbeat: it was taken for a stall, re-created with a warning).
            self.caught_up = out.caught_up = self._handover = self._caught_up_reported = True
            self._last_activity = time.monotonic()
            return out
        if not msgs and not self._stale and self.idle_for() > STALL_S:
            # (No heartbeat while the connection is down is that outage, which the bridge says once.)
            log.log(logging.WARNING if self.bridge.connected else logging.DEBUG,
                    "watch %s: no heartbeat for %.1fs; re-creating consumer", self.filter_subject, self.idle_for())
            await self._try_recreate("stalled")
        return out


async def _api(bridge: Bridge, subject: str, body: dict[str, Any] | None = None,
               timeout: float | None = None) -> dict[str, Any]:
    """`bridge.api`, where "no responders" means JetStream is not answering (`Unavailable`), not that
    something does not exist: only an error reply from the server says that. "No responders" and
    "JetStream system temporarily unavailable" (a cluster electing a leader after losing a node) are
    asked again for up to `FAILOVER_S`, and so are requests that only read (`INFO`, `STREAM.INFO`...)
    and got no answer at all: the connection's server may just have been lost. While there is no
    connection at all, a call waits for one up to the request timeout in all (not once per attempt),
    then fails (`NoConnection`)."""
    start = trio.current_time()
    deadline = start + FAILOVER_S
    read_only = subject.startswith(_READ_ONLY_API)
    while True:
        attempt_timeout = timeout
        if read_only and timeout is None and trio.current_time() < deadline:
            # A clustered stream without a leader leaves its INFO unanswered: ask again soon rather than
            # wait the whole request timeout once.
            attempt_timeout = min(bridge.request_timeout, _READ_ATTEMPT_S)
        try:
            return await bridge.api(subject, body, attempt_timeout)
        except NoConnection:
            # (Each attempt already waited for a connection; another one must end within the request timeout.)
            next_end = trio.current_time() + _FAILOVER_PAUSE_S + min(bridge.request_timeout, _READ_ATTEMPT_S)
            if not read_only or trio.current_time() >= deadline or next_end > start + bridge.request_timeout:
                raise
        except NotFound as e:
            if trio.current_time() >= deadline:
                raise Unavailable(f"JetStream API {subject}: {e}") from None
        except Unavailable:
            if not read_only or trio.current_time() >= deadline:
                raise
        except JetStreamAPIError as e:
            if e.err_code != ERR_CLUSTER_NOT_AVAILABLE or trio.current_time() >= deadline:
                raise
        await trio.sleep(_FAILOVER_PAUSE_S)


async def _stream_info(bridge: Bridge, name: str) -> StreamState:
    try:
        return _stream_state(await _api(bridge, f"STREAM.INFO.{name}"))
    except JetStreamAPIError as e:
        if e.err_code == ERR_STREAM_NOT_FOUND or e.code == 404:
            raise NotFound(f"no stream {name}") from None
        raise


class _StreamUpdates:
    """`JetStreams.stream_updates`: stream names from the advisory subjects (the name is the last token)."""

    def __init__(self, sub: Subscription):
        self._sub = sub

    async def next(self) -> list[str]:
        while True:
            names = [m.subject[len(STREAM_UPDATED_ADVISORY):] for m in await self._sub.next_batch()
                     if m.subject.startswith(STREAM_UPDATED_ADVISORY)]
            if names:
                return names

    async def close(self) -> None:
        await self._sub.unsubscribe()
