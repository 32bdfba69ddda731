"""The stream operations the ADR-20 layer is built on, as a small protocol with two implementations.

`natsfs.jetstream.JetStreams` speaks to a real server through the bridge; `natsfs.memstreams.MemoryStreams`
keeps streams in memory so the whole filesystem can be tested without a server or a kernel. Both raise
`natsfs.errors` exceptions with the same meaning: `NotFound` (no such stream), `Conflict` (expected
last subject sequence did not match), `NoSpace` (stream limits refuse the message), `ReadOnly` (sealed).
"""

from __future__ import annotations

import contextvars
from collections import Counter
from collections.abc import AsyncIterable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from .errors import InvalidArgument, NatsFSError

# The FUSE operation the current task serves (the adapter sets it around each request; tasks a request
# starts inherit it), so that server calls made for requests are told from background ones.
SERVING: contextvars.ContextVar[str | None] = contextvars.ContextVar("natsfs_serving", default=None)


class CallCounter(Counter[str]):
    """Server calls per method (`calls[method] += n`), as the daemon's stats show them, and of those the
    ones made while serving a FUSE request, per operation (`for_requests`): a request answered from
    memory adds none there, whatever the background tasks (watches, polls, uploads) ask meanwhile."""

    def __init__(self, *args: Any, **kwargs: int) -> None:
        self.for_requests: Counter[str] = Counter()
        super().__init__(*args, **kwargs)  # (as Counter's: `copy()` makes one from another)

    def __setitem__(self, key: str, value: int) -> None:
        op = SERVING.get()
        if op is not None:
            self.for_requests[op] += value - self.get(key, 0)
        super().__setitem__(key, value)

# Header names used on the wire.
ROLLUP = "Nats-Rollup"
EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
EXPECTED_STREAM = "Nats-Expected-Stream"
# Stored only if the stream's last message carries this `Nats-Msg-Id` (any message stored without an id
# clears it; a duplicate leaves it as it was). Verified on nats-server 2.15: checked after the
# expected-subject-sequence header, refused with err_code 10070.
EXPECTED_LAST_MSG_ID = "Nats-Expected-Last-Msg-Id"
# JetStream de-duplication: a message whose id the stream saw within its duplicate window is not stored
# again (the ack says `duplicate`). Checked after the expected-sequence headers.
MSG_ID = "Nats-Msg-Id"
# Atomic batch publish (nats-server >= 2.12, stream flag `allow_atomic`): every message of a batch carries
# the batch id and its 1-based position; the last one carries the commit. Nothing of a batch is visible
# before its commit is stored; a batch that is refused, incomplete or idle for `BATCH_IDLE_S` is dropped.
BATCH_ID = "Nats-Batch-Id"
BATCH_SEQUENCE = "Nats-Batch-Sequence"
BATCH_COMMIT = "Nats-Batch-Commit"
BATCH_MAX_MSGS = 1000
MAX_STREAM_NAME = 255  # nats-server refuses a longer stream name (err_code 10052)
BATCH_IDLE_S = 10.0


# A message's payload: bytes, or the bytearray the bridge's lean connection received it into (no copy);
# nobody modifies one after it is handed over.
Payload = bytes | bytearray


@dataclass(slots=True)
class StoredMsg:
    """One message as stored in a stream."""

    seq: int
    subject: str
    headers: dict[str, str] | None
    data: Payload
    time_ns: int
    # Direct gets only: how many messages on `subject` come after this one (`Nats-Num-Pending`) when
    # the reply was made; -1 when not known.
    pending: int = -1


@dataclass
class StreamState:
    """What the layers above need of a stream's info."""

    name: str
    config: dict[str, Any]
    messages: int = 0
    bytes: int = 0
    first_seq: int = 0
    last_seq: int = 0
    created_ns: int = 0

    @property
    def sealed(self) -> bool:
        return bool(self.config.get("sealed"))

    @property
    def max_bytes(self) -> int:
        return int(self.config.get("max_bytes", -1) or -1)


@dataclass
class AccountLimits:
    """JetStream limits and usage of the account (for statfs when a bucket has no max_bytes)."""

    max_storage: int = -1
    max_memory: int = -1
    storage_used: int = 0
    memory_used: int = 0


@dataclass
class WatchBatch:
    """Messages delivered by a watch, and whether the initial snapshot has been fully delivered."""

    msgs: list[StoredMsg] = field(default_factory=list)
    caught_up: bool = False
    reset: bool = False  # the watch restarted from scratch: the consumer must rebuild its view


class Watch(Protocol):
    async def next_batch(self, timeout: float | None = None) -> WatchBatch: ...

    async def close(self) -> None: ...


class MsgBatches(Protocol):
    """The replies of one batched get, handed over as they arrive; `next()` is None after the last."""

    async def next(self) -> list[StoredMsg] | None: ...

    async def close(self) -> None: ...


class StreamUpdates(Protocol):
    """The names of streams whose config was changed (by any client), as the server announces them."""

    async def next(self) -> list[str]:
        """The streams updated since the last call (waits for at least one)."""

    async def close(self) -> None: ...


# The advisory nats-server publishes after a stream's config was updated (the stream's name last).
STREAM_UPDATED_ADVISORY = "$JS.EVENT.ADVISORY.STREAM.UPDATED."


class Streams(Protocol):
    # Calls made so far, per method name (and `batch_msgs`: messages of atomic batches), for the stats.
    calls: CallCounter

    @property
    def max_payload(self) -> int:
        """The largest message the server takes."""

    @property
    def subject_limit(self) -> int | None:
        """The longest subject the server was found to take (None: not found out, see
        `Bridge.subject_limit`)."""

    @property
    def connected(self) -> bool:
        """Whether there is a connection to the server now (False while reconnecting)."""

    async def stream_names(self) -> list[str]: ...

    async def stream_info(self, name: str) -> StreamState: ...

    async def stream_infos(self) -> list[StreamState]:
        """The info of every stream of the account (STREAM.LIST); a stream the server could not
        describe (no leader) is left out."""

    async def create_stream(self, config: dict[str, Any]) -> StreamState: ...

    async def update_stream(self, config: dict[str, Any]) -> StreamState: ...

    async def delete_stream(self, name: str) -> None: ...

    async def account_limits(self) -> AccountLimits: ...

    async def publish(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> int: ...

    async def publish_many(self, msgs: Sequence[tuple[str, bytes, dict[str, str] | None]],
                           window: int = 32) -> list[int]: ...

    async def publish_each(self, msgs: Sequence[tuple[str, bytes, dict[str, str] | None]]
                           ) -> list[int | NatsFSError]:
        """Publish `msgs` in this order, all in flight at once, and return each one's outcome (its
        sequence, or the error it got: `Unavailable` when no ack came) without sending any again."""

    async def purge_subject(self, stream: str, subject: str, *, before_seq: int = 0) -> None:
        """Remove the messages on `subject` (a filter); with `before_seq`, only those below that sequence."""

    async def last_msg(self, stream: str, subject: str) -> StoredMsg | None: ...

    async def get_batch(self, stream: str, subject: str, start_seq: int, batch: int,
                        max_bytes: int) -> list[StoredMsg]: ...

    async def stream_batch(self, stream: str, subject: str, start_seq: int, batch: int,
                           max_bytes: int) -> MsgBatches:
        """Like `get_batch`, handing the messages over as they arrive."""

    async def subject_index(self, stream: str, subject: str) -> list[tuple[int, int]]: ...

    async def subject_count(self, stream: str, filter_subject: str) -> int:
        """How many subjects matching `filter_subject` hold messages, without listing them."""

    async def subject_counts(self, stream: str, filter_subject: str) -> tuple[dict[str, int], int, bool]:
        """(messages per matching subject, the stream's last sequence L when listed, whether the listing is
        complete: a subject not counted held no message at some moment after the stream ended at L, as in
        one snapshot)."""

    async def publish_batch(self, batch_id: str,
                            messages: Callable[[], AsyncIterable[tuple[str, bytes, dict[str, str]]]]) -> int:
        """Publish `messages()` as one atomic batch (the last one commits it) and return the commit's
        sequence; `messages` may be called again to send a batch cut off before its commit once more.
        `OutcomeUnknown` when the commit was sent and its ack did not come back (stored or not: read
        back); any other error means nothing of the batch was stored."""

    async def sequences(self, stream: str, start_seq: int, stop_seq: int) -> list[int]: ...

    async def watch(self, stream: str, filter_subject: str, *, last_per_subject: bool = True) -> Watch: ...

    async def stream_updates(self) -> StreamUpdates:
        """Follow the server's advisories of stream config updates (none arrive where the account may
        not subscribe to them: then nothing is announced)."""


def literal_subject(subject: str) -> bool:
    """Whether `subject` names one subject: no empty token and no wildcard token (`*`, `>`). JetStream
    stores a message another client published to `$O.b.M.>` or `$O.b.C.*` under that very subject, but a
    purge (or a last-message request) by it applies to every subject it matches."""
    return all(token and token not in ("*", ">") for token in subject.split("."))


def check_purge_filter(subject: str) -> None:
    """Refuse a purge by a subject that is not literal: every purge natsfs makes is of one subject, and
    one by a wildcard (a subject taken from the stream, where another client stored it) would remove
    the messages of every subject it matches, other objects' metas or chunks."""
    if not literal_subject(subject):
        raise InvalidArgument(f"not purging {subject!r}: a wildcard subject matches other subjects too")


def limit_refusal(subject: str, description: str) -> str:
    """The text of a publish that the stream's limits refused (a full bucket, account or disk). The
    refusal is about the stream, not the one message: an Object Store subject (`$O.<bucket>.M.<name>` or
    `.C.<nuid>`) is named by its bucket, so that every refused file of a full bucket gives the same text
    (the log's repeat filter then merges a run of them into one line) and no log line carries a base64
    meta subject that names no file a user knows."""
    parts = subject.split(".", 3)
    where = f"bucket {parts[1]}" if len(parts) == 4 and parts[0] == "$O" and parts[2] in ("M", "C") else subject
    return f"{where}: refused by the server: {description}"


def parse_rfc3339_ns(text: str) -> int:
    """Nanoseconds since the epoch from an RFC 3339 timestamp with up to nanosecond precision."""
    text = text.strip()
    frac_ns = 0
    if "." in text:
        head, rest = text.split(".", 1)
        digits = ""
        i = 0
        while i < len(rest) and rest[i].isdigit():
            digits += rest[i]
            i += 1
        tz = rest[i:]
        frac_ns = int((digits + "000000000")[:9]) if digits else 0
        text = head + tz
    if text.endswith("Z") or text.endswith("z"):
        text = text[:-1] + "+00:00"
    dt = datetime.fromisoformat(text)
    return int(dt.timestamp()) * 1_000_000_000 + frac_ns
