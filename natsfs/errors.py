"""Domain exceptions: every failure the daemon knows about carries an errno and a log level.

Only `natsfs.fs` turns these into `pyfuse3.FUSEError`; everything below raises these. Keeping
the errno next to the cause means the boundary never has to guess what went wrong.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import logging
from collections.abc import Iterator


class NatsFSError(Exception):
    """Base of all expected failures. `errno` is what the caller of the syscall sees."""

    errno: int = _errno.EIO
    log_level: int = logging.ERROR

    def __init__(self, message: str = "", *, errno: int | None = None, log_level: int | None = None):
        super().__init__(message or self.__class__.__name__)
        if errno is not None:
            self.errno = errno
        if log_level is not None:
            self.log_level = log_level


class NotFound(NatsFSError):
    errno = _errno.ENOENT
    log_level = logging.DEBUG


class DetachedPath(NotFound):
    """A path under the inode table's placeholder for inodes whose name went away (`inodes.DETACHED`):
    nothing lives there, and nothing may be stored there (a request by such an inode, e.g. a rename into
    a directory removed or replaced meanwhile, fails as on a local disk)."""


class AlreadyExists(NatsFSError):
    errno = _errno.EEXIST
    log_level = logging.DEBUG


class NotADirectory(NatsFSError):
    errno = _errno.ENOTDIR
    log_level = logging.DEBUG


class IsADirectory(NatsFSError):
    errno = _errno.EISDIR
    log_level = logging.DEBUG


class InvalidArgument(NatsFSError):
    errno = _errno.EINVAL
    log_level = logging.INFO


class PermissionDenied(NatsFSError):
    errno = _errno.EACCES
    log_level = logging.WARNING


class NotPermitted(PermissionDenied):
    """The NATS server refused a message (or subscription) for the user's permissions (`-ERR 'Permissions
    Violation for Publish to "<subject>"'`). Definite: a refused publish reached no stream, nothing of it
    was stored; the connection stays. The bridge logs one line per kind of refusal (`bridge.refusal`),
    so this one is DEBUG wherever else it surfaces."""

    log_level = logging.DEBUG

    def __init__(self, message: str, *, kind: str, subject: str):
        super().__init__(message)
        self.kind = kind  # "publish" or "subscription"
        self.subject = subject


class ReadOnly(NatsFSError):
    errno = _errno.EROFS
    log_level = logging.INFO


class NotEmpty(NatsFSError):
    errno = _errno.ENOTEMPTY
    log_level = logging.DEBUG


class NoSpace(NatsFSError):
    errno = _errno.ENOSPC
    log_level = logging.WARNING


class NotKept(NatsFSError):
    """The bytes of an upload that could not be stored could not be written to lost+found either (a
    full or failing local disk): they stay staged (`WriteState.UNKEPT`) and keeping them is retried.
    ENOSPC unless the disk said otherwise."""

    errno = _errno.ENOSPC
    log_level = logging.ERROR


class Stale(NatsFSError):
    """The version a handle was reading has been replaced and its chunks purged."""

    errno = _errno.ESTALE
    log_level = logging.WARNING


class KernelSizeStale(NatsFSError):
    """An open pinned a version of another size than the one the kernel holds for the inode: the kernel
    walks the path again, asking for fresh attributes, and retries the open (see `FileSystem.open`)."""

    errno = _errno.ESTALE
    log_level = logging.DEBUG


class Corrupt(NatsFSError):
    """Data read back does not match its meta (digest, size, chunk count)."""

    errno = _errno.EIO
    log_level = logging.ERROR


class Conflict(NatsFSError):
    """Another client changed an object since this mount read it (optimistic concurrency).

    ESTALE, as for a reader whose version was purged: the version this handle holds is no longer
    the object's current one."""

    errno = _errno.ESTALE
    log_level = logging.WARNING


class Unavailable(NatsFSError):
    """The server could not be reached or did not answer in time."""

    errno = _errno.EIO
    log_level = logging.ERROR


class NoConnection(Unavailable):
    """There was no connection to the server, and none came back within the request timeout: the
    request was never sent. Asking again at once is pointless (it would wait as long again)."""


class OutcomeUnknown(Unavailable):
    """A publish left this client but its acknowledgement never came back (timeout, lost or replaced
    connection): the message may or may not be stored. Callers settle it by reading back."""


class WrongLastMsgId(NatsFSError):
    """A publish that expected the stream's last message to be a given one (`Nats-Expected-Last-Msg-Id`)
    found another there, and was not stored. Internal: the ADR-20 layer then publishes it the plain way."""

    errno = _errno.EAGAIN
    log_level = logging.DEBUG


class NameTooLong(NatsFSError):
    """A path component over 255 bytes, or a meta subject over what the server accepts."""

    errno = _errno.ENAMETOOLONG
    log_level = logging.INFO


class BadName(NatsFSError):
    """A name no ADR-20 client can use (not UTF-8)."""

    errno = _errno.EILSEQ
    log_level = logging.INFO


class TooBig(NatsFSError):
    """A meta document over the server's max payload, or metadata over the mount's limit."""

    errno = _errno.E2BIG
    log_level = logging.INFO


class MarkerShaped(NatsFSError):
    """A store that would make another client's object `x/` with bytes (a file, shown as `x%2F`) a directory
    marker, or replace it by one: an empty version of that file (every natsfs mount would show the
    directory `x` instead, and hide a file `x`), or the marker a `chmod`/`utime` of the directory `x`
    needs. Refused before anything is sent."""

    errno = _errno.EPERM
    log_level = logging.INFO


class OverStreamLimits(TooBig):
    """A version the bucket's stream limits could never hold whole (more chunks than its
    `max_msgs_per_subject`, more bytes than its `max_bytes` or more messages than its `max_msgs` with
    discard old): refused before anything is sent, as a message over `max_msg_size` is (`E2BIG`)."""

    log_level = logging.WARNING


class NotWhole(NatsFSError):
    """A version that was stored (every chunk and its meta acknowledged) but that the stream's limits
    (discard old, `max_age`) already cut part of: it is taken back and the one it replaced is kept. The
    close's line is a warning: the ERROR line is the one that says where the file's bytes are kept."""

    errno = _errno.EIO
    log_level = logging.WARNING


class MalformedMeta(NatsFSError):
    """A meta message that is not valid ADR-20 (bad JSON, missing nuid, ...)."""

    errno = _errno.EIO


class StoredButSkipped(MalformedMeta):
    """A meta this mount stored is one it skips when it reads it (another client's meta, rewritten with
    its other fields kept: see `ObjectStore.defuse_wildcard_nuid`): stored, and shown as before, not at all."""
    log_level = logging.WARNING


class JetStreamAPIError(NatsFSError):
    """An error reply from the JetStream API, with the server's codes kept for callers to inspect."""

    def __init__(self, description: str, *, code: int = 0, err_code: int = 0):
        super().__init__(f"{description} (code {code}, err_code {err_code})")
        self.description = description
        self.code = code
        self.err_code = err_code
        if code == 404:
            self.errno = _errno.ENOENT
            self.log_level = logging.DEBUG


def single_error(exc: BaseException) -> BaseException:
    """The exception that explains a failure which may come wrapped in (nested) exception groups from trio
    nurseries: the first domain error (`NatsFSError`) inside, else the one exception a chain of
    single-member groups holds, else `exc` itself. The one place groups are unwrapped, so a nursery's
    failure surfaces with its own errno and message."""
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    for leaf in exc.exceptions:
        found = single_error(leaf)
        if isinstance(found, NatsFSError):
            return found
    return single_error(exc.exceptions[0]) if len(exc.exceptions) == 1 else exc


@contextlib.contextmanager
def single_errors() -> Iterator[None]:
    """Around a nursery: its failure surfaces as the exception `single_error` finds in the group (the
    group itself when no one exception explains it)."""
    try:
        yield
    except BaseExceptionGroup as group:
        error = single_error(group)
        if error is group:
            raise
        raise error from None


# JetStream err_codes the daemon reacts to (nats-server's server/errors.json). Errors are classified by
# these, never by their description text, which the server words differently between versions.
ERR_ACCOUNT_RESOURCES_EXCEEDED = 10002  # resource limits exceeded for account
ERR_INSUFFICIENT_RESOURCES = 10023
ERR_MEMORY_RESOURCES_EXCEEDED = 10028
ERR_NO_MESSAGE_FOUND = 10037
ERR_STORAGE_RESOURCES_EXCEEDED = 10047
ERR_MAXIMUM_STREAMS = 10027  # maximum number of streams reached (the account's max_streams)
ERR_STREAM_MAX_BYTES_OVER_ACCOUNT = 10122  # stream max bytes exceeds account limit max stream bytes
# A stream (bucket) the account's JetStream limits leave no room for: its count, or storage to reserve.
ERR_ACCOUNT_LIMITS_FOR_A_STREAM = frozenset({ERR_MAXIMUM_STREAMS, ERR_ACCOUNT_RESOURCES_EXCEEDED,
                                             ERR_INSUFFICIENT_RESOURCES, ERR_MEMORY_RESOURCES_EXCEEDED,
                                             ERR_STORAGE_RESOURCES_EXCEEDED, ERR_STREAM_MAX_BYTES_OVER_ACCOUNT})
ERR_MSG_TOO_BIG = 10054  # message size exceeds maximum allowed
ERR_STREAM_NAME_IN_USE = 10058
ERR_STREAM_NOT_FOUND = 10059
ERR_STREAM_MISMATCH = 10060  # Nats-Expected-Stream names another stream
# A batch refused because the stream does not allow atomic publish.
ERR_ATOMIC_DISABLED = 10174
# A batch refused because a message id in it was seen within the stream's duplicate window.
ERR_BATCH_DUPLICATE_ID = 10201
ERR_WRONG_LAST_SEQUENCE = 10071
ERR_WRONG_LAST_MSG_ID = 10070  # Nats-Expected-Last-Msg-Id did not match the stream's last message
ERR_STORE_FAILED = 10077  # the stream refused to store: maximum messages/bytes (per subject) exceeded
ERR_HEADER_TOO_BIG = 10097
ERR_STREAM_SEALED = 10109
ERR_DUPLICATE_IN_PROCESS = 10158  # a publish with the same Nats-Msg-Id is still being stored
ERR_WRONG_LAST_SEQUENCE_CONSTANT = 10164  # "wrong last sequence" as newer servers send it
