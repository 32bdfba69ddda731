"""`Streams` in memory: the JetStream semantics the ADR-20 layer relies on, without a server or a kernel.

`MemoryStreams` owns streams kept in process memory and behaves like nats-server where natsfs can tell:
stream configs (subjects with `*`/`>` wildcards, `max_bytes`/`max_msgs` with discard new or old,
`max_msgs_per_subject`, `sealed`), one monotonically increasing sequence per stream, message timestamps,
the headers `Nats-Rollup`, `Nats-Expected-Last-Subject-Sequence`/`Nats-Expected-Stream` and `Nats-Msg-Id`
(de-duplication within the stream's `duplicate_window`, checked after the expected sequence, as the server
does), subject purges (optionally below a sequence),
atomic batches (`publish_batch`: all or nothing at the commit, dropped when cut off, at most
`max_open_batches` open),
direct gets (last per subject, batched next-by-subject with `max_bytes`; a stream whose config does not
have `allow_direct` answers batched gets as `JetStreams` does for one, from `STREAM.MSG.GET` requests:
without the count of messages after each, `pending` -1), headers-only subject scans and
ordered watches (last per subject, or everything, then live). It raises the `natsfs.errors` exceptions
`natsfs.jetstream.JetStreams` raises for the same causes. Every operation is a trio checkpoint, so
concurrent callers interleave as they would over a network. Tests can count calls (`calls`), inject
failures (`fail_next`, `fail_next_publish`), lose the ack of a publish that was stored (`lose_next_ack`),
hold plain publishes in the server's queue while reads and purges are answered (`hold_publishes`,
`release_held`: as nats-server, which stores a stream's publishes in order from its inbound queue but
answers `STREAM.MSG.GET`, direct gets and purges elsewhere) and restart watches (`reset_watches`).

Objects are written into it the way nats.go does by the test-only writers in `tests/gowriters.py`.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import AsyncIterable, Callable, Sequence
from typing import Any

import trio

from .errors import (
    ERR_ATOMIC_DISABLED,
    ERR_BATCH_DUPLICATE_ID,
    ERR_MSG_TOO_BIG,
    ERR_STREAM_MISMATCH,
    AlreadyExists,
    Conflict,
    InvalidArgument,
    JetStreamAPIError,
    NatsFSError,
    NoConnection,
    NoSpace,
    NotFound,
    OutcomeUnknown,
    ReadOnly,
    Unavailable,
    WrongLastMsgId,
)
from .streams import (
    BATCH_MAX_MSGS,
    EXPECTED_LAST_MSG_ID,
    EXPECTED_LAST_SUBJECT_SEQ,
    EXPECTED_STREAM,
    MAX_STREAM_NAME,
    MSG_ID,
    ROLLUP,
    AccountLimits,
    CallCounter,
    StoredMsg,
    StreamState,
    WatchBatch,
    check_purge_filter,
    limit_refusal,
)


class _HeldPublish(Unavailable):
    """A publish held in the server's queue (`MemoryStreams.hold_publishes`): sent, not answered."""


# Defaults nats-server fills into a stream config (so equal configs compare equal however they were written).
_CONFIG_DEFAULTS: dict[str, Any] = {
    "retention": "limits", "max_consumers": -1, "max_msgs": -1, "max_bytes": -1, "max_age": 0,
    "max_msgs_per_subject": -1, "max_msg_size": -1, "discard": "old", "storage": "file", "num_replicas": 1,
    "duplicate_window": 120 * 10**9, "sealed": False, "deny_delete": False, "deny_purge": False,
    "allow_rollup_hdrs": False, "allow_direct": False, "compression": "none", "allow_atomic": False,
}
ERR_STREAM_SUBJECT_OVERLAP = 10065
ERR_ROLLUP_NOT_PERMITTED = 10115
ERR_BATCH_TOO_LARGE = 10199
ERR_BATCH_TOO_MANY = 10210


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, `>` one or more trailing tokens."""
    ptoks, stoks = pattern.split("."), subject.split(".")
    for i, tok in enumerate(ptoks):
        if tok == ">":
            return len(stoks) > i
        if i >= len(stoks) or (tok != "*" and tok != stoks[i]):
            return False
    return len(ptoks) == len(stoks)


def subjects_overlap(a: str, b: str) -> bool:
    """Whether some subject matches both patterns."""
    ta, tb = a.split("."), b.split(".")
    for i in range(max(len(ta), len(tb))):
        if i >= len(ta) or i >= len(tb):
            return False
        x, y = ta[i], tb[i]
        if x == ">" or y == ">":
            return True
        if x != y and "*" not in (x, y):
            return False
    return True


def stored_size(subject: str, headers: dict[str, str] | None, data: bytes | bytearray) -> int:
    """Bytes a message counts against limits (nats-server's memory store: subject + headers + data + 16)."""
    hdr = 0
    if headers:
        hdr = len("NATS/1.0\r\n\r\n") + sum(len(k) + len(v) + 4 for k, v in headers.items())
    return len(subject) + hdr + len(data) + 16


def _normalize(config: dict[str, Any]) -> dict[str, Any]:
    if not config.get("name"):
        raise InvalidArgument("stream config has no name")
    name = str(config["name"])
    if any(c in name for c in ".*> \t\r\n/\\"):
        raise InvalidArgument(f"invalid stream name {name!r}")
    out = dict(_CONFIG_DEFAULTS)
    out.update({k: v for k, v in config.items() if v is not None})
    # (As nats-server: a stream without subjects takes its name as one, unless it is a mirror or has
    # sources, which then takes no publishes at all.)
    out["subjects"] = list(out.get("subjects") or ([] if out.get("mirror") or out.get("sources") else [name]))
    return out


class _Stream:
    __slots__ = ("by_subject", "bytes", "changed", "config", "created_ns", "deleted", "last_msg_id", "last_seq",
                 "last_ts", "msg_ids", "msgs", "name", "watches")

    def __init__(self, config: dict[str, Any], created_ns: int):
        self.name: str = config["name"]
        self.config = config
        self.created_ns = created_ns
        self.msgs: dict[int, StoredMsg] = {}  # insertion order is sequence order
        self.by_subject: dict[str, list[int]] = {}
        self.last_seq = 0
        self.last_ts = 0
        self.bytes = 0
        self.deleted = False
        self.changed = trio.Event()
        self.watches: set[MemoryWatch] = set()
        self.msg_ids: dict[str, tuple[int, int]] = {}  # Nats-Msg-Id -> (seq, time stored)
        self.last_msg_id = ""  # the id of the last message stored ("" for one without), as the server keeps it

    def wake(self) -> None:
        changed, self.changed = self.changed, trio.Event()
        changed.set()

    def takes(self, subject: str) -> bool:
        return any(subject_matches(p, subject) for p in self.config["subjects"])

    def remove(self, seq: int) -> None:
        m = self.msgs.pop(seq)
        self.bytes -= stored_size(m.subject, m.headers, m.data)
        seqs = self.by_subject[m.subject]
        del seqs[bisect.bisect_left(seqs, seq)]
        if not seqs:
            del self.by_subject[m.subject]

    def purge(self, subject: str, keep_last: int = 0) -> int:
        seqs = self.by_subject.get(subject, [])
        doomed = seqs[: len(seqs) - keep_last] if keep_last else list(seqs)
        for seq in doomed:
            self.remove(seq)
        return len(doomed)

    def state(self) -> StreamState:
        first = next(iter(self.msgs)) if self.msgs else (self.last_seq + 1 if self.last_seq else 0)
        return StreamState(name=self.name, config=dict(self.config), messages=len(self.msgs), bytes=self.bytes,
                           first_seq=first, last_seq=self.last_seq, created_ns=self.created_ns)

    def on_subject(self, subject: str, start_seq: int) -> list[int]:
        seqs = self.by_subject.get(subject, [])
        return seqs[bisect.bisect_left(seqs, start_seq):]


class MemoryStreams:
    """The `natsfs.streams.Streams` protocol over streams held in memory."""

    def __init__(self, *, max_storage: int = -1, max_memory: int = -1, clock: Callable[[], int] = time.time_ns,
                 delay: float = 0.0, watch_batch: int = 256, stream_group: int = 1):
        self.max_storage = max_storage
        self.max_memory = max_memory
        self.clock = clock
        self.delay = delay  # seconds every operation sleeps (trio time), to widen races in tests
        self.watch_batch = watch_batch  # most messages one watch batch delivers
        self.stream_group = stream_group  # messages per `next()` of a `stream_batch`
        self.calls = CallCounter()
        self._streams: dict[str, _Stream] = {}
        self._faults: list[tuple[str, str | None, BaseException]] = []
        self._lost_acks: list[str | None] = []
        self.max_payload = 1024 * 1024
        self.subject_limit: int | None = None  # (a real server's max_control_line, learned: see Bridge)
        # Batches open at once (nats-server counts them per stream; tests use one stream at a time).
        self.max_open_batches = 50
        self.open_batches = 0
        self._offline_wait: float | None = None  # see `go_offline`
        self._holding = False  # see `hold_publishes`
        self._hold_from: str | None = None
        self._held: list[tuple[str, bytes, dict[str, str] | None]] = []
        self._stopped: trio.Event | None = None  # see `stop`
        self._stop_from: str | None = None
        self._stop_reached = trio.Event()
        self._update_followers: list[MemoryStreamUpdates] = []  # see `stream_updates`

    # ------------------------------------------------------------------ faults
    def fail_next(self, op: str, exc: BaseException, *, subject: str | None = None, times: int = 1) -> None:
        """Make the next `times` calls of operation `op` (a method name) raise `exc`.

        For "publish" the fault applies per message (also inside `publish_many`), and with `subject` only
        to messages whose subject matches that pattern.
        """
        self._faults.extend((op, subject, exc) for _ in range(times))

    def fail_next_publish(self, exc: BaseException, *, subject: str | None = None) -> None:
        self.fail_next("publish", exc, subject=subject)

    def lose_next_ack(self, *, subject: str | None = None, times: int = 1) -> None:
        """The next `times` publishes (matching `subject`) are stored, but their ack is lost: the publisher
        gets `OutcomeUnknown`, as after a dropped connection."""
        self._lost_acks.extend([subject] * times)

    def _ack_lost(self, subject: str) -> bool:
        for i, pattern in enumerate(self._lost_acks):
            if pattern is None or subject_matches(pattern, subject):
                del self._lost_acks[i]
                return True
        return False

    def hold_publishes(self, *, from_subject: str | None = None) -> None:
        """From now on (with `from_subject`: from the first publish matching that pattern on) plain
        publishes (`publish`, `publish_many`, `publish_each`) are queued, not processed, and their
        publisher gets no ack (`Unavailable`), until `release_held`: a server that has read them from
        the connection but not yet stored them (or refused them), while it answers reads and purges at
        once. Atomic batches are not held."""
        self._holding = True
        self._hold_from = from_subject

    def release_held(self, count: int | None = None) -> list[int | NatsFSError]:
        """Process the first `count` held publishes (all, and stop holding, when None), in the order
        they were sent, as the server would; returns each one's outcome (its ack went nowhere)."""
        if count is None:
            self._holding = False
            count = len(self._held)
        taken, self._held = self._held[:count], self._held[count:]
        outcomes: list[int | NatsFSError] = []
        for subject, data, headers in taken:
            try:
                outcomes.append(self._store(subject, data, headers))
            except NatsFSError as e:
                outcomes.append(e)
        return outcomes

    @property
    def held(self) -> list[tuple[str, bytes, dict[str, str] | None]]:
        """The publishes held so far (see `hold_publishes`), oldest first."""
        return list(self._held)

    def go_offline(self, wait: float) -> None:
        """Behave like a client whose server is away: every call waits `wait` seconds (trio time, the
        request timeout it waits for a connection) and fails with `NoConnection`, until `go_online`."""
        self._offline_wait = wait

    def go_online(self) -> None:
        self._offline_wait = None

    @property
    def connected(self) -> bool:
        return self._offline_wait is None

    def stop(self, *, from_subject: str | None = None) -> trio.Event:
        """Behave like a server that was stopped (SIGSTOP) while the connection stays open: `connected`
        stays True and every call waits, unanswered, until `go_on` (then it is answered as usual). With
        `from_subject`: from the first publish matching that pattern on (the messages published before
        it, also earlier ones of the same `publish_many`, are stored). Returns an event set once a call
        waits."""
        self._stopped = trio.Event()
        self._stop_from = from_subject
        self._stop_reached = trio.Event()
        return self._stop_reached

    def go_on(self) -> None:
        """The stopped server goes on (SIGCONT): the calls waiting since `stop` are answered."""
        stopped, self._stopped, self._stop_from = self._stopped, None, None
        if stopped is not None:
            stopped.set()

    async def _wait_while_stopped(self, subject: str | None = None) -> None:
        stopped = self._stopped
        if stopped is None:
            return
        if self._stop_from is not None:
            if subject is None or not subject_matches(self._stop_from, subject):
                return
            self._stop_from = None  # stopped here: every call from now on waits
        self._stop_reached.set()
        await stopped.wait()

    def _fault(self, op: str, subject: str | None = None) -> None:
        for i, (fop, pattern, exc) in enumerate(self._faults):
            if fop == op and (pattern is None or subject is None or subject_matches(pattern, subject)):
                del self._faults[i]
                raise exc

    async def _enter(self, op: str) -> None:
        self.calls[op] += 1
        await self._wait_while_stopped()
        wait = self._offline_wait
        if wait is not None:
            await trio.sleep(wait)
            raise NoConnection(f"{op}: no connection to NATS (reconnecting for {wait:g}s and more)")
        if self.delay > 0:
            await trio.sleep(self.delay)
        else:
            await trio.lowlevel.checkpoint()
        if op != "publish":
            self._fault(op)

    def reset_watches(self, stream: str | None = None) -> None:
        """Make open watches start over (as after a lost consumer): next batch has `reset=True`."""
        for st in self._streams.values():
            if stream is None or st.name == stream:
                for w in st.watches:
                    w.reset_pending = True
                st.wake()

    def _get(self, name: str) -> _Stream:
        st = self._streams.get(name)
        if st is None:
            raise NotFound(f"no stream {name}")
        return st

    # ------------------------------------------------------------------ streams
    async def stream_names(self) -> list[str]:
        await self._enter("stream_names")
        return sorted(self._streams)

    async def stream_info(self, name: str) -> StreamState:
        await self._enter("stream_info")
        return self._get(name).state()

    async def stream_infos(self) -> list[StreamState]:
        await self._enter("stream_infos")
        return [self._streams[name].state() for name in sorted(self._streams)]

    def _check_subjects(self, config: dict[str, Any], exclude: str | None = None) -> None:
        for other in self._streams.values():
            if other.name == exclude:
                continue
            for a in config["subjects"]:
                for b in other.config["subjects"]:
                    if subjects_overlap(a, b):
                        raise JetStreamAPIError(f"subjects overlap with an existing stream ({other.name})",
                                                code=400, err_code=ERR_STREAM_SUBJECT_OVERLAP)

    async def create_stream(self, config: dict[str, Any]) -> StreamState:
        await self._enter("create_stream")
        cfg = _normalize(config)
        if len(cfg["name"]) > MAX_STREAM_NAME:  # (as nats-server answers it)
            raise JetStreamAPIError(f"stream name is too long, maximum allowed is {MAX_STREAM_NAME}",
                                    code=500, err_code=10052)
        existing = self._streams.get(cfg["name"])
        if existing is not None:
            if existing.config != cfg:
                raise AlreadyExists(f"stream {cfg['name']} exists with a different configuration")
            return existing.state()
        self._check_subjects(cfg)
        st = _Stream(cfg, self.clock())
        self._streams[st.name] = st
        return st.state()

    async def update_stream(self, config: dict[str, Any]) -> StreamState:
        await self._enter("update_stream")
        cfg = _normalize(config)
        st = self._get(cfg["name"])
        if st.config.get("sealed") and not cfg.get("sealed"):
            raise InvalidArgument(f"stream {st.name} is sealed and cannot be unsealed")
        if cfg.get("storage") != st.config.get("storage"):
            raise InvalidArgument(f"stream {st.name}: the storage type cannot change")
        self._check_subjects(cfg, exclude=st.name)
        st.config = cfg
        # As nats-server does, the new limits apply to what the stream holds at once (oldest first).
        per_subject = int(cfg.get("max_msgs_per_subject", -1))
        if per_subject > 0:
            for subject in list(st.by_subject):
                st.purge(subject, keep_last=per_subject)
        max_bytes, max_msgs = int(cfg.get("max_bytes", -1)), int(cfg.get("max_msgs", -1))
        while st.msgs and ((max_bytes > 0 and st.bytes > max_bytes) or (max_msgs > 0 and len(st.msgs) > max_msgs)):
            st.remove(next(iter(st.msgs)))
        for follower in list(self._update_followers):
            follower.announce(st.name)
        return st.state()

    async def delete_stream(self, name: str) -> None:
        await self._enter("delete_stream")
        st = self._streams.pop(name, None)
        if st is None:
            raise NotFound(f"no stream {name}")
        st.deleted = True
        st.wake()

    def recreate_stream(self, name: str) -> None:
        """Delete stream `name` and create it again with the same config, at once (no other task runs in
        between, as when another client does both faster than a watch notices): a new, empty stream whose
        sequences start over at 1 and whose creation time differs, as nats-server makes it."""
        old = self._get(name)
        created_ns = max(self.clock(), old.created_ns + 1)
        self._streams[name] = _Stream(dict(old.config), created_ns)
        old.deleted = True
        old.wake()

    async def account_limits(self) -> AccountLimits:
        await self._enter("account_limits")
        return AccountLimits(max_storage=self.max_storage, max_memory=self.max_memory,
                             storage_used=self._used("file"), memory_used=self._used("memory"))

    def _used(self, storage: str) -> int:
        return sum(st.bytes for st in self._streams.values() if st.config.get("storage") == storage)

    # ------------------------------------------------------------------ messages
    async def publish(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> int:
        await self._wait_while_stopped(subject)
        await self._enter("publish")
        return self._acked(subject, self._publish(subject, bytes(data), headers))

    async def publish_many(self, msgs: Sequence[tuple[str, bytes, dict[str, str] | None]],
                           window: int = 32) -> list[int]:
        await self._enter("publish_many")
        seqs: list[int] = []
        held: _HeldPublish | None = None
        for subject, data, headers in msgs:
            await self._wait_while_stopped(subject)
            try:
                seqs.append(self._acked(subject, self._publish(subject, bytes(data), headers)))
            except _HeldPublish as e:  # (all of them are sent: the rest are held behind it)
                held = held or e
        if held is not None:
            raise held
        return seqs

    async def publish_each(self, msgs: Sequence[tuple[str, bytes, dict[str, str] | None]]
                           ) -> list[int | NatsFSError]:
        await self._enter("publish_each")
        outcomes: list[int | NatsFSError] = []
        for subject, data, headers in msgs:
            await self._wait_while_stopped(subject)
            try:
                outcomes.append(self._acked(subject, self._publish(subject, bytes(data), headers)))
            except NatsFSError as e:
                outcomes.append(e)
        return outcomes

    async def publish_batch(self, batch_id: str,
                            messages: Callable[[], AsyncIterable[tuple[str, bytes, dict[str, str]]]]) -> int:
        """An atomic batch as nats-server 2.12+ stores it: nothing is visible before the commit, and the
        commit stores every message or none (a refusal of any message drops the batch). A "publish"
        fault injected for a message of the batch cuts the batch off there, as a killed publisher does:
        nothing is stored. A lost ack (`lose_next_ack`) applies to the commit."""
        await self._enter("publish_batch")
        if self.open_batches >= self.max_open_batches:
            raise JetStreamAPIError("atomic publish too many inflight", code=429, err_code=ERR_BATCH_TOO_MANY)
        self.open_batches += 1
        try:
            return await self._publish_batch(batch_id, messages())
        finally:
            self.open_batches -= 1

    async def _publish_batch(self, batch_id: str, msgs: AsyncIterable[tuple[str, bytes, dict[str, str]]]) -> int:
        received: list[tuple[str, bytes, dict[str, str]]] = []
        async for subject, data, headers in msgs:
            await self._wait_while_stopped(subject)
            if received:
                try:
                    self._fault("publish", received[-1][0])
                except OutcomeUnknown as e:  # only a commit can be stored without an ack
                    raise Unavailable(f"batch {batch_id} cut off: {e}") from None
            received.append((subject, bytes(data), dict(headers)))
            await trio.lowlevel.checkpoint()
        if not received:
            raise InvalidArgument(f"batch {batch_id} is empty")
        self._fault("publish", received[-1][0])
        subject = received[-1][0]
        st = next((s for s in self._streams.values() if s.takes(received[0][0])), None)
        if st is None:
            raise NotFound(f"no stream takes {received[0][0]}")
        if not st.config.get("allow_atomic"):
            raise JetStreamAPIError("atomic publish is disabled", code=400, err_code=ERR_ATOMIC_DISABLED)
        if len(received) > BATCH_MAX_MSGS:
            raise JetStreamAPIError("atomic publish batch is too large", code=400, err_code=ERR_BATCH_TOO_LARGE)
        ids = [h.get(MSG_ID) for _, _, h in received if h.get(MSG_ID)]
        window = int(st.config.get("duplicate_window", 120 * 10**9))
        if len(set(ids)) != len(ids) or any(
                i in st.msg_ids and self.clock() - st.msg_ids[i][1] < window for i in ids):
            raise JetStreamAPIError("atomic publish batch contains duplicate message id", code=400,
                                    err_code=ERR_BATCH_DUPLICATE_ID)
        saved = (dict(st.msgs), {k: list(v) for k, v in st.by_subject.items()}, st.last_seq, st.last_ts, st.bytes,
                 dict(st.msg_ids), st.last_msg_id)
        seq = 0
        try:
            for subj, data, headers in received:
                seq = self._store(subj, data, headers)
        except BaseException:
            st.msgs, st.by_subject, st.last_seq, st.last_ts, st.bytes, st.msg_ids, st.last_msg_id = saved
            raise
        return self._acked(subject, seq)

    def _acked(self, subject: str, seq: int) -> int:
        if self._ack_lost(subject):
            raise OutcomeUnknown(f"publish to {subject}: no ack (injected)")
        return seq

    def _publish(self, subject: str, data: bytes, headers: dict[str, str] | None) -> int:
        if self._holding and (self._held or self._hold_from is None or subject_matches(self._hold_from, subject)):
            self._held.append((subject, data, dict(headers) if headers else None))
            raise _HeldPublish(f"publish to {subject}: no ack (held in the server's queue, injected)")
        return self._store(subject, data, headers)

    def _store(self, subject: str, data: bytes, headers: dict[str, str] | None) -> int:
        self._fault("publish", subject)
        st = next((s for s in self._streams.values() if s.takes(subject)), None)
        if st is None:
            raise NotFound(f"no stream takes {subject}")
        cfg = st.config
        headers = dict(headers) if headers else None
        h = headers or {}
        if cfg.get("sealed"):
            raise ReadOnly(f"{subject}: stream {st.name} is sealed")
        if EXPECTED_STREAM in h and h[EXPECTED_STREAM] != st.name:
            raise JetStreamAPIError("expected stream does not match", code=400, err_code=ERR_STREAM_MISMATCH)
        if EXPECTED_LAST_SUBJECT_SEQ in h:
            seqs = st.by_subject.get(subject)
            last = seqs[-1] if seqs else 0
            if int(h[EXPECTED_LAST_SUBJECT_SEQ]) != last:
                raise Conflict(f"{subject}: wrong last sequence: {last}")
        if EXPECTED_LAST_MSG_ID in h and h[EXPECTED_LAST_MSG_ID] != st.last_msg_id:
            raise WrongLastMsgId(f"{subject}: wrong last msg ID: {st.last_msg_id}")
        msg_id = h.get(MSG_ID)
        window = int(cfg.get("duplicate_window", 120 * 10**9))
        if msg_id:
            seen = st.msg_ids.get(msg_id)
            if seen is not None and self.clock() - seen[1] < window:
                return seen[0]  # a duplicate: acknowledged with the original's sequence, not stored
        rollup = h.get(ROLLUP)
        if rollup is not None:
            if not cfg.get("allow_rollup_hdrs"):
                raise JetStreamAPIError("rollup not permitted", code=400, err_code=ERR_ROLLUP_NOT_PERMITTED)
            if rollup not in ("sub", "all"):
                raise JetStreamAPIError(f"rollup value invalid: {rollup!r}", code=400)
        size = stored_size(subject, headers, data)
        max_msg_size = int(cfg.get("max_msg_size", -1))
        if 0 <= max_msg_size < len(data):
            raise JetStreamAPIError("message size exceeds maximum allowed", code=400, err_code=ERR_MSG_TOO_BIG)
        max_bytes, max_msgs = int(cfg.get("max_bytes", -1)), int(cfg.get("max_msgs", -1))
        discard_new = cfg.get("discard") == "new"
        if discard_new and max_bytes > 0 and st.bytes + size > max_bytes:
            raise NoSpace(limit_refusal(subject, "maximum bytes exceeded"))
        if discard_new and max_msgs > 0 and len(st.msgs) + 1 > max_msgs:
            raise NoSpace(limit_refusal(subject, "maximum messages exceeded"))
        limit = self.max_memory if cfg.get("storage") == "memory" else self.max_storage
        if limit > 0 and self._used(str(cfg.get("storage"))) + size > limit:
            raise NoSpace(limit_refusal(subject, "insufficient resources"))
        st.last_seq += 1
        st.last_ts = max(self.clock(), st.last_ts)
        seq = st.last_seq
        st.msgs[seq] = StoredMsg(seq, subject, headers, data, st.last_ts)
        st.by_subject.setdefault(subject, []).append(seq)
        st.bytes += size
        st.last_msg_id = msg_id or ""
        if msg_id:
            st.msg_ids[msg_id] = (seq, st.last_ts)
            while st.msg_ids:  # forget ids past the window (the oldest come first)
                oldest = next(iter(st.msg_ids))
                if st.last_ts - st.msg_ids[oldest][1] < window:
                    break
                del st.msg_ids[oldest]
        if rollup == "sub":
            st.purge(subject, keep_last=1)
        elif rollup == "all":
            for s in [s for s in st.msgs if s != seq]:
                st.remove(s)
        per_subject = int(cfg.get("max_msgs_per_subject", -1))
        if per_subject > 0:
            st.purge(subject, keep_last=per_subject)
        while st.msgs and ((max_bytes > 0 and st.bytes > max_bytes) or (max_msgs > 0 and len(st.msgs) > max_msgs)):
            st.remove(next(iter(st.msgs)))  # discard old
        st.wake()
        return seq

    async def purge_subject(self, stream: str, subject: str, *, before_seq: int = 0) -> None:
        await self._enter("purge_subject")
        check_purge_filter(subject)
        st = self._get(stream)
        if st.config.get("sealed"):
            raise ReadOnly(f"stream {stream} is sealed")
        if st.config.get("deny_purge"):
            raise JetStreamAPIError("stream purge not permitted", code=400)
        matching = [s for s in st.by_subject if subject_matches(subject, s)]
        for s in matching:
            if before_seq:
                for seq in [q for q in st.by_subject[s] if q < before_seq]:
                    st.remove(seq)
            else:
                st.purge(s)

    async def last_msg(self, stream: str, subject: str) -> StoredMsg | None:
        await self._enter("last_msg")
        st = self._get(stream)
        seqs = st.by_subject.get(subject)
        return st.msgs[seqs[-1]] if seqs else None

    def _select(self, st: _Stream, subject: str, start_seq: int, batch: int, max_bytes: int) -> list[StoredMsg]:
        """A batched direct get: like the server's replies, each carries its subject, its sequence and
        how many messages on the subject follow it (`Nats-Num-Pending`). A stream without `allow_direct`
        is read as `JetStreams` reads one, with `STREAM.MSG.GET`: no such count (-1)."""
        out: list[StoredMsg] = []
        total = 0
        counted = bool(st.config.get("allow_direct"))
        if not counted:
            self.calls["msg_get"] += 1
        following = st.on_subject(subject, max(start_seq, 1))
        for i, seq in enumerate(following):
            if len(out) >= batch or (out and max_bytes > 0 and total >= max_bytes):
                break
            m = st.msgs[seq]
            out.append(StoredMsg(m.seq, m.subject, m.headers, m.data, m.time_ns,
                                 len(following) - i - 1 if counted else -1))
            total += len(m.data)
        return out

    async def get_batch(self, stream: str, subject: str, start_seq: int, batch: int,
                        max_bytes: int) -> list[StoredMsg]:
        await self._enter("get_batch")
        return self._select(self._get(stream), subject, start_seq, batch, max_bytes)

    async def stream_batch(self, stream: str, subject: str, start_seq: int, batch: int,
                           max_bytes: int) -> MemoryBatchStream:
        """Like `get_batch`, handing the messages over a few at a time (as `JetStreams.stream_batch`)."""
        await self._enter("stream_batch")
        return MemoryBatchStream(self._select(self._get(stream), subject, start_seq, batch, max_bytes),
                                 self.stream_group)

    async def delete_msg(self, stream: str, seq: int) -> None:
        """Remove one message (`$JS.API.STREAM.MSG.DELETE`): how another client can break an object."""
        await self._enter("delete_msg")
        st = self._get(stream)
        if seq not in st.msgs:
            raise JetStreamAPIError("no message found", code=400, err_code=10057)
        st.remove(seq)

    async def subject_index(self, stream: str, subject: str) -> list[tuple[int, int]]:
        await self._enter("subject_index")
        st = self._get(stream)
        return [(seq, len(st.msgs[seq].data)) for seq in st.by_subject.get(subject, [])]

    async def sequences(self, stream: str, start_seq: int, stop_seq: int) -> list[int]:
        """The sequences in [start_seq, stop_seq) that hold a message (as `JetStreams.sequences`)."""
        await self._enter("sequences")
        return [seq for seq in self._get(stream).msgs if start_seq <= seq < stop_seq]

    async def subject_count(self, stream: str, filter_subject: str) -> int:
        """How many subjects matching `filter_subject` hold messages (as `JetStreams.subject_count`)."""
        await self._enter("subject_count")
        return sum(1 for s in self._get(stream).by_subject if subject_matches(filter_subject, s))

    async def subject_counts(self, stream: str, filter_subject: str) -> tuple[dict[str, int], int, bool]:
        """(messages per matching subject, last sequence, complete) as `JetStreams.subject_counts`."""
        await self._enter("subject_counts")
        st = self._get(stream)
        counts = {s: len(q) for s, q in st.by_subject.items() if subject_matches(filter_subject, s)}
        return counts, st.last_seq, True

    async def watch(self, stream: str, filter_subject: str, *, last_per_subject: bool = True) -> MemoryWatch:
        await self._enter("watch")
        return MemoryWatch(self, self._get(stream), filter_subject, last_per_subject)

    async def stream_updates(self) -> MemoryStreamUpdates:
        """Every `update_stream` from now on is announced, as nats-server's advisory."""
        await self._enter("stream_updates")
        follower = MemoryStreamUpdates(self)
        self._update_followers.append(follower)
        return follower

    # ------------------------------------------------------------------ inspection (tests)
    def messages(self, stream: str) -> list[StoredMsg]:
        """Every message a stream holds, in sequence order."""
        return list(self._get(stream).msgs.values())

    def subjects(self, stream: str) -> dict[str, int]:
        """Message count per subject."""
        return {s: len(q) for s, q in self._get(stream).by_subject.items()}


class MemoryBatchStream:
    """The messages of one batched get, `group` per `next()`; None after the last."""

    def __init__(self, msgs: list[StoredMsg], group: int):
        self._msgs = msgs
        self._group = max(1, group)
        self._pos = 0
        self.done = False

    async def next(self) -> list[StoredMsg] | None:
        await trio.lowlevel.checkpoint()
        if self.done or self._pos >= len(self._msgs):
            self.done = True
            return None
        out = self._msgs[self._pos : self._pos + self._group]
        self._pos += len(out)
        return out

    async def close(self) -> None:
        self.done = True


class MemoryWatch:
    """An ordered consumer: the snapshot (last per subject, or all), then every later message, live."""

    def __init__(self, owner: MemoryStreams, stream: _Stream, filter_subject: str, last_per_subject: bool):
        self._owner = owner
        self._stream = stream
        self.filter_subject = filter_subject
        self.last_per_subject = last_per_subject
        self.caught_up = False
        self.reset_pending = False
        self.closed = False
        self._snapshot: list[int] = []
        self._pos = 0
        self._next_live = 0
        self._start()
        stream.watches.add(self)

    def _start(self) -> None:
        st = self._stream
        subjects = [s for s in st.by_subject if subject_matches(self.filter_subject, s)]
        if self.last_per_subject:
            self._snapshot = sorted(st.by_subject[s][-1] for s in subjects)
        else:
            self._snapshot = sorted(seq for s in subjects for seq in st.by_subject[s])
        self._pos = 0
        self._next_live = st.last_seq + 1
        self.caught_up = False

    def _take_snapshot(self, out: WatchBatch) -> None:
        st = self._stream
        while self._pos < len(self._snapshot) and len(out.msgs) < self._owner.watch_batch:
            m = st.msgs.get(self._snapshot[self._pos])
            self._pos += 1
            if m is not None:  # purged since the watch started
                out.msgs.append(m)
        if self._pos >= len(self._snapshot):
            self.caught_up = True

    def _take_live(self, out: WatchBatch) -> None:
        st = self._stream
        while self._next_live <= st.last_seq and len(out.msgs) < self._owner.watch_batch:
            m = st.msgs.get(self._next_live)
            self._next_live += 1
            if m is not None and subject_matches(self.filter_subject, m.subject):
                out.msgs.append(m)

    async def next_batch(self, timeout: float | None = None) -> WatchBatch:
        await self._owner._enter("watch_next")
        deadline = trio.current_time() + timeout if timeout is not None else float("inf")
        while True:
            if self._stream.deleted:
                raise NotFound(f"no stream {self._stream.name}")
            out = WatchBatch()
            if self.closed:
                out.caught_up = self.caught_up
                return out
            if self.reset_pending:
                self.reset_pending = False
                self._start()
                out.reset = True
            if not self.caught_up:
                self._take_snapshot(out)
                out.caught_up = self.caught_up
                return out
            self._take_live(out)
            out.caught_up = True
            if out.msgs or out.reset:
                return out
            changed = self._stream.changed
            with trio.move_on_at(deadline) as scope:
                await changed.wait()
            if scope.cancelled_caught:
                if self._stream.deleted:
                    raise NotFound(f"no stream {self._stream.name}")
                return out

    async def close(self) -> None:
        self.closed = True
        self._stream.watches.discard(self)


class MemoryStreamUpdates:
    """`MemoryStreams.stream_updates`: the names of the streams updated since the last `next()`."""

    def __init__(self, owner: MemoryStreams):
        self._owner = owner
        self._names: list[str] = []
        self._wake = trio.Event()

    def announce(self, name: str) -> None:
        self._names.append(name)
        self._wake.set()

    async def next(self) -> list[str]:
        while not self._names:
            await self._wake.wait()
            self._wake = trio.Event()
        names, self._names = self._names, []
        return names

    async def close(self) -> None:
        if self in self._owner._update_followers:
            self._owner._update_followers.remove(self)
