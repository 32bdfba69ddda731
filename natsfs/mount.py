"""Mounting: build the layers of one mount (`natsfs.compose`), run pyfuse3 under trio, tear down cleanly.

Owns the trio nursery every background task lives in, the mount/unmount calls, signal handling
(SIGTERM/SIGINT/SIGHUP → `pyfuse3.terminate()`, caught until the daemon is done: `_ShutdownSignals`),
the embedded server's lifetime, and readiness reporting.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import signal
import stat
import sys
from collections.abc import Callable
from pathlib import Path

import pyfuse3
import trio

from . import affinity, memory, sdnotify
from .adr20 import chunk_size_within
from .auth import Connection
from .bridge import Bridge
from .compose import build_filesystem, spool_root
from .config import Config
from .errors import NatsFSError, NotFound
from .fs import Operations
from .jetstream import JetStreams
from .kernel import clone_device, session_device_fd
from .secrecy import private_dir, redact_urls
from .server import EmbeddedServer
from .uploader import UploadWorker

log = logging.getLogger(__name__)


SWITCH_INTERVAL = 0.0005


class MountError(Exception):
    """A mount that cannot start; the message is the one sentence the user sees."""


def check_mountpoint(mountpoint: Path) -> None:
    if not os.path.exists("/dev/fuse"):
        raise MountError("/dev/fuse is missing: this machine cannot mount FUSE filesystems")
    try:
        st = os.stat(mountpoint)
    except (FileNotFoundError, NotADirectoryError):
        raise MountError(f"mountpoint {mountpoint} does not exist") from None
    except OSError as e:
        if e.errno == errno.ENOTCONN:  # (a FUSE mount whose daemon died; it stays until unmounted)
            kind = "natsfs" if (_fs_type(mountpoint) or "").endswith("natsfs") else "FUSE"
            raise MountError(f"mountpoint {mountpoint} is a {kind} mount whose daemon is gone: unmount it first "
                             f"(natsfs umount {mountpoint})") from None
        raise MountError(f"cannot use mountpoint {mountpoint}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise MountError(f"mountpoint {mountpoint} is not a directory")
    if os.path.ismount(mountpoint):
        raise MountError(f"mountpoint {mountpoint} is already a mount point (busy)")


def _fs_type(mountpoint: Path) -> str | None:
    """The type /proc/self/mounts gives the (last) mount on `mountpoint`, e.g. `fuse.natsfs`."""
    found = None
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 2 and fields[1].replace("\\040", " ") == str(mountpoint):
                found = fields[2]
    return found


def lock_mountpoint(mountpoint: Path) -> int | None:
    """Wait for, and take, the right to mount on `mountpoint` (an flock on the directory, released by
    closing the returned fd once the mount is live or has failed): `check_mountpoint` and the mount itself
    are then one step, and of two mounts started together on one directory the second is refused as
    "already a mount point" instead of stacking on the first. None (no lock) on a directory this user may
    mount on but not read."""
    try:
        fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except PermissionError:
        return None
    except OSError as e:
        raise MountError(f"cannot use mountpoint {mountpoint}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


DAEMON_LOCK = "daemon.lock"


def lock_cache_root(root: Path, mountpoint: Path) -> int:
    """Take, for the daemon's whole life, the right to use this mountpoint's directory under the cache dir
    (spool, put journal, write-back journal, lost+found). An unmount returns while its daemon may still be
    finishing (settling puts, storing directory times, write-back uploads, its embedded server): a new
    mount of the same mountpoint waits for it, with one line, instead of moving the spool files that
    daemon still uses to lost+found as leftovers, or writing the journals it writes. The fd is never
    closed (and not inherited), so the lock goes with the process, also a killed one."""
    private_dir(root)
    fd = os.open(root / DAEMON_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.warning("waiting for the daemon of an earlier mount of %s to finish (it still uses %s)",
                    mountpoint, root)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        log.info("the daemon of the earlier mount of %s has finished", mountpoint)
    except BaseException:
        os.close(fd)
        raise
    return fd


def fuse_options(config: Config) -> set[str]:
    options = set(pyfuse3.default_options)
    # nodev: a device node any client of the bucket can describe must never open a device of this host.
    options |= {"fsname=natsfs", "subtype=natsfs", "nodev"}
    if config.read_only:
        options.add("ro")
    options |= set(config.fuse_options)
    return options


async def serve(config: Config, on_ready: Callable[[], None] = lambda: None) -> None:
    """Mount and serve until unmounted or signalled. Raises `MountError` if the mount cannot start."""
    mountpoint = config.mountpoint.resolve()
    check_mountpoint(mountpoint)
    # (Waited for here, not in a trio worker thread: one started now would keep the CPU affinity the
    # daemon's threads have before `affinity.share_one_cpu`. Nothing else runs yet.)
    lock_fd = lock_mountpoint(mountpoint)

    def unlock() -> None:
        nonlocal lock_fd
        if lock_fd is not None:
            os.close(lock_fd)
            lock_fd = None

    def mounted() -> None:
        unlock()
        on_ready()

    try:
        check_mountpoint(mountpoint)  # (again: another mount may have taken the lock first, and mounted)
        try:
            lock_cache_root(spool_root(config.cache_dir, mountpoint), mountpoint)  # (held until exit)
        except OSError as e:
            where = f" ({e.filename})" if e.filename else ""
            raise MountError(f"cannot use the cache dir {config.cache_dir}: {e.strerror or e}{where}") from None
        await _serve_locked(config, mountpoint, mounted)
    finally:
        unlock()


async def _serve_locked(config: Config, mountpoint: Path, on_ready: Callable[[], None]) -> None:
    # The FUSE (trio) thread and the NATS (asyncio) thread hand the GIL back and forth all the
    # time; the default 5 ms switch interval makes each FUSE request wait behind a NATS burst.
    sys.setswitchinterval(SWITCH_INTERVAL)
    memory.keep_freed_buffers()
    if config.cpus == "one":
        affinity.share_one_cpu()
    embedded: EmbeddedServer | None = None
    servers = list(config.servers)
    if not servers:
        embedded = EmbeddedServer(config.data_dir)
        try:
            servers = [await trio.to_thread.run_sync(embedded.start)]
        except NatsFSError as e:
            raise MountError(f"could not start the embedded nats-server: {e}") from None
        # The embedded server takes only its own credentials; nothing else configured applies to it.
        user, password = embedded.auth or (None, None)
        config = dataclasses.replace(config, credentials=Connection(user=user, password=password))
    async with trio.open_nursery() as signal_nursery:
        signals = _ShutdownSignals(signal_nursery)
        try:
            await _serve(config, mountpoint, servers, on_ready, signals)
        finally:
            with trio.CancelScope(shield=True):
                if embedded is not None:
                    await trio.to_thread.run_sync(embedded.stop)
            # Only now, with everything stored or kept and closed, may a signal end the process.
            signal_nursery.cancel_scope.cancel()


async def _keep_cpu_free() -> None:
    """Move the daemon's threads off their CPU when other work takes it over (`affinity.Rebalancer`;
    two procfs reads every few seconds, done here)."""
    rebalancer = affinity.Rebalancer()
    while True:
        await trio.sleep(affinity.CHECK_S)
        rebalancer.check()


async def _serve(config: Config, mountpoint: Path, servers: list[str], on_ready: Callable[[], None],
                 signals: _ShutdownSignals) -> None:
    bridge = Bridge(servers, request_timeout=config.request_timeout, auth=config.credentials)
    try:
        await bridge.connect()
    except NatsFSError as e:
        raise MountError(str(e)) from None
    chunk_size = chunk_size_within(config.chunk_size, bridge.max_payload)
    if chunk_size != config.chunk_size:
        log.warning("writing objects in chunks of %d bytes, not %d: the server takes messages of at most %d "
                    "bytes (max_payload)", chunk_size, config.chunk_size, bridge.max_payload)
        config = dataclasses.replace(config, chunk_size=chunk_size)
    try:
        worker = UploadWorker(dataclasses.replace(config.credentials, servers=tuple(servers)))
        try:
            built = build_filesystem(config, JetStreams(bridge), file_sender=worker)
        except OSError as e:  # (the spool under --cache-dir: a file in the way, no permission, ...)
            where = f" ({e.filename})" if e.filename else ""
            raise MountError(f"cannot use the cache dir {config.cache_dir}: {e.strerror or e}{where}") from None
        if config.bucket is not None:
            try:
                await built.store.bucket_status(config.bucket)
            except NotFound:
                raise MountError(f"no bucket named {config.bucket!r} on {redact_urls(servers)}") from None
        fs = built.fs
        async with trio.open_nursery() as nursery:
            try:
                await built.start(nursery)
            except NatsFSError as e:
                raise MountError(f"cannot read buckets: {e}") from None
            if config.upload_worker:
                await worker.start(nursery)
            try:
                pyfuse3.init(built.ops, str(mountpoint), fuse_options(config))
            except RuntimeError as e:
                raise MountError(f"cannot mount {mountpoint}: {e}") from None
            try:
                session_fd = session_device_fd()
                # (a notifier that dies is replaced by one on a new clone of the same session)
                fs.kernel.attach(clone_device(session_fd), reopen=lambda: clone_device(session_fd))
            except OSError as e:
                log.warning("cannot send invalidations to the kernel (%s); its caches expire after %g s",
                            e, config.entry_timeout)
            log.info("mounted %s on %s", config.bucket or "all buckets", mountpoint)
            readahead = KernelReadahead(mountpoint, config.kernel_readahead_kb)
            built.ops.before_first_open = readahead.apply
            nursery.start_soon(readahead.apply_soon, built.ops)
            if config.cpus == "one":
                nursery.start_soon(_keep_cpu_free)
            try:
                await signals.start(unstored=lambda: sum(1 for sf in fs.staging.all() if sf.unstored),
                                    hurry=fs.cut_shutdown_short, shutdown_timeout=config.shutdown_timeout,
                                    kept_in="the write-back journal" if config.write_back is not None else "lost+found")
                on_ready()
                await pyfuse3.main()
            finally:
                signals.fuse_ended()  # from here on, a signal must not touch the (closing) FUSE session
                with trio.CancelScope(shield=True):
                    await fs.kernel.close()
                    # Every request was answered: the staged bytes are all the writers were told
                    # were written. Requests not read yet get ENOTCONN once the session is gone.
                    try:
                        await fs.shutdown(config.shutdown_timeout)
                    except Exception:
                        log.exception("storing open files at unmount failed; staged bytes stay in the spool "
                                      "and are rescued at the next mount")
                    pyfuse3.close(unmount=True)
                    await worker.close()
                log.info("unmounted %s", mountpoint)
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await bridge.close()


class KernelReadahead:
    """Let the kernel send 1 MiB reads instead of 128 KiB ones (fewer, larger FUSE requests).

    The kernel sets the device's readahead (sysfs `read_ahead_kb` of the mount's bdi) when it processes
    our INIT reply, to at most the 128 KiB default, so the setting can only be raised after that. A file
    takes the device's readahead when it is opened, so it is raised before the first open is answered
    (`Operations.before_first_open`; INIT is answered by then), and otherwise as soon as INIT was. The
    device number comes from /proc/self/mountinfo: stat() on our own mountpoint would deadlock. Needs
    root; otherwise the kernel default stays.
    """

    def __init__(self, mountpoint: Path, kb: int):
        self.mountpoint = mountpoint
        self.kb = kb
        self.done = kb <= 0

    def apply(self) -> None:
        """Raise it now (once INIT has been answered); after one attempt, whatever came of it, never again."""
        if self.done:
            return
        self.done = True
        try:
            bdi: Path | None = None
            with open("/proc/self/mountinfo") as f:
                for line in f:
                    fields = line.split()
                    if len(fields) > 4 and fields[4] == str(self.mountpoint):
                        bdi = Path("/sys/class/bdi") / fields[2] / "read_ahead_kb"
            if bdi is None:
                log.debug("could not raise kernel readahead: %s is not in /proc/self/mountinfo", self.mountpoint)
                return
            if bdi.read_text().strip() != str(self.kb):
                bdi.write_text(str(self.kb))
            log.debug("kernel readahead on %s is %d KiB", self.mountpoint, self.kb)
        except OSError as e:
            log.debug("could not raise kernel readahead: %s", e)

    async def apply_soon(self, ops: Operations) -> None:
        """Raise it once the kernel has INIT's answer, if no open came first."""
        for _ in range(200):
            if self.done:
                return
            if ops.initialized:
                # pyfuse3 calls `init` and answers INIT in one step: any later task runs after the answer.
                self.apply()
                return
            await trio.sleep(0.01)


class _ShutdownSignals:
    """SIGTERM/SIGINT/SIGHUP, caught from the moment the FUSE loop runs until the daemon is done (open
    files stored or kept, connections closed, the kernel mount gone; `serve` ends it).

    The first one ends the FUSE loop (`pyfuse3.terminate()`), which starts the shutdown. The second (or
    the first after an unmount started the shutdown) is logged once and changes nothing: the shutdown goes
    on as started, bounded by --shutdown-timeout. The third stops the wait for uploads (one line): what is
    not stored yet is kept as at the timeout, under its name (lost+found, or the write-back journal), and
    the unmount is as clean as ever. Later ones are ignored. Letting the handlers go at the first signal
    gave a second one its default action (death, mid-shutdown: the open writers neither stored nor kept
    under their names, the mount left dead); only SIGKILL may end the daemon that way.
    `pyfuse3.terminate()` is called only while the loop runs (terminating a session that has already
    ended, e.g. after a lazy unmount, crashes libfuse)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self, nursery: trio.Nursery):
        self._nursery = nursery
        self._fuse_running = False
        self._shutting_down = False
        self._repeats = 0  # signals after the one that started the shutdown (or after it started)
        self._unstored: Callable[[], int] = lambda: 0
        self._hurry: Callable[[str], None] = lambda why: None
        self._timeout = 0.0
        self._kept_in = "lost+found"

    async def start(self, *, unstored: Callable[[], int], hurry: Callable[[str], None], shutdown_timeout: float,
                    kept_in: str) -> None:
        """Catch them from now on. `unstored` counts the files the shutdown still has to store, `hurry`
        stops its wait for them (saying why), `kept_in` says where what is not stored goes."""
        self._unstored, self._hurry = unstored, hurry
        self._timeout, self._kept_in = shutdown_timeout, kept_in
        self._fuse_running = True
        await self._nursery.start(self._receive)

    def fuse_ended(self) -> None:
        self._fuse_running = False
        self._shutting_down = True

    async def _receive(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(*self.SIGNALS) as received:
            task_status.started()
            async for signum in received:
                name = signal.Signals(signum).name
                if self._fuse_running and not self._shutting_down:
                    self._shutting_down = True
                    log.info("received %s: unmounting", name)
                    sdnotify.notify("STOPPING=1", "STATUS=storing open files and unmounting")
                    pyfuse3.terminate()
                    continue
                self._repeats += 1
                if self._repeats == 1:
                    log.warning("received %s: already shutting down; waiting for %d file(s) still to store (at "
                                "most --shutdown-timeout %g s, then they are kept in %s), then unmounting; one "
                                "more signal stops that wait", name, self._unstored(), self._timeout, self._kept_in)
                elif self._repeats == 2:
                    log.warning("received %s again: not waiting for uploads any longer; %d file(s) not stored "
                                "yet are kept in %s, then the mount is unmounted", name, self._unstored(),
                                self._kept_in)
                    self._hurry(f"shutdown cut short by {name}")
