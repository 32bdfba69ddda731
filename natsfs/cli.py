"""Command line: `natsfs mount|umount|bucket|fsck ...`, option parsing, exit codes, one-sentence errors.

`natsfs mount` without `--foreground` starts the daemon as a child process and waits until it
reports the mount live (exit 0) or reports why it could not start (exit 1, one sentence). The child
reports over a pipe named by the hidden `--ready-fd` option. The child runs isolated (`python -I`),
and the server URLs (which may carry credentials) reach it through another pipe (`--servers-fd`),
never on its command line or in its environment.

The daemon's log file is created 0600 in a directory created 0700, and is reopened when logrotate
moves it away.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import logging
import logging.handlers
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio

from . import config as cfg
from .config import Config, default_flush_timeout, parse_duration, parse_size
from .errors import single_error
from .secrecy import child_environment

log = logging.getLogger("natsfs")


def _servers(arg: str | None) -> tuple[str, ...]:
    raw = arg or os.environ.get("NATS_URL", "")
    return tuple(s.strip() for s in raw.split(",") if s.strip())


def _fuse_opts(values: list[str] | None) -> tuple[str, ...]:
    out: list[str] = []
    for v in values or []:
        out.extend(o.strip() for o in v.split(",") if o.strip())
    return tuple(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="natsfs", description="Mount NATS JetStream Object Store buckets.")
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("mount", help="mount buckets on a directory")
    m.add_argument("mountpoint", type=Path)
    m.add_argument("--server", help="NATS URL(s), comma separated (default: $NATS_URL, else an embedded server)")
    m.add_argument("--bucket", help="mount only this bucket, as the root")
    m.add_argument("--foreground", action="store_true", help="stay in the foreground until unmounted")
    m.add_argument("--cache-dir", type=Path, default=cfg.default_cache_dir())
    m.add_argument("--cache-size", default="256MiB", help="chunk cache size in memory (e.g. 256MiB, 1GiB)")
    m.add_argument("--spool-size", default="16GiB", help="local disk for staged writes")
    m.add_argument("--chunk-size", default="128KiB", help="chunk size of objects written through the mount")
    m.add_argument("--max-meta-bytes", default="16KiB", help="largest meta the mount will write")
    m.add_argument("--request-timeout", default="10s",
                   help="how long a request to the server may take (an unanswered write is settled for 3 times this)")
    m.add_argument("--data-dir", type=Path, default=cfg.default_data_dir(),
                   help="where the embedded nats-server keeps its store")
    m.add_argument("--read-only", action="store_true")
    m.add_argument("--allow-setuid", action="store_true",
                   help="show setuid, setgid and sticky bits stored in object metadata (masked off by default)")
    m.add_argument("-o", dest="options", action="append", help="FUSE mount options (comma separated)")
    m.add_argument("--storage", choices=("file", "memory"), default="file", help="storage of new buckets")
    m.add_argument("--replicas", type=int, default=1, help="replicas of new buckets")
    m.add_argument("--compression", action="store_true", help="compress new buckets (s2)")
    m.add_argument("--max-bytes", default="-1", help="size limit of new buckets (-1: none)")
    m.add_argument("--ttl", default="0", help="object TTL of new buckets (e.g. 7d; 0: none)")
    m.add_argument("--entry-timeout", default="60s",
                   help="how long the kernel may keep names and attributes without asking (changes are "
                        "pushed to it anyway)")
    m.add_argument("--flush-timeout",
                   help="close/fsync fail with EIO when a file is not stored within this (plus 1 s per MiB); "
                        "default 10s, 30s with several servers (a cluster's election after a node loss)")
    m.add_argument("--shutdown-timeout", default="60s",
                   help="at unmount or SIGTERM, how long to spend storing files still open for writing")
    m.add_argument("--write-back", nargs="?", const="0s", default=None, metavar="DELAY",
                   help="close returns once the bytes are durable on local disk (spool file and journal "
                        "fsynced); they are uploaded in the background DELAY later (default 0s) and replayed "
                        "by the next mount with the same --cache-dir if the daemon dies")
    m.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    m.add_argument("--log-file", type=Path, help="log here (default: stderr in the foreground)")
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    m.add_argument("--servers-fd", type=int, help=argparse.SUPPRESS)

    u = sub.add_parser("umount", help="unmount a natsfs mount")
    u.add_argument("mountpoint", type=Path)

    b = sub.add_parser("bucket", help="manage buckets")
    b.add_argument("--server", help="NATS URL(s) (default: $NATS_URL, else the embedded server if running)")
    bsub = b.add_subparsers(dest="bucket_command", required=True)
    bc = bsub.add_parser("create")
    bc.add_argument("name")
    bc.add_argument("--description", default="")
    bc.add_argument("--storage", choices=("file", "memory"), default="file")
    bc.add_argument("--replicas", type=int, default=1)
    bc.add_argument("--compression", action="store_true")
    bc.add_argument("--max-bytes", default="-1")
    bc.add_argument("--ttl", default="0")
    bc.add_argument("--no-atomic", action="store_true",
                    help="no atomic batches: puts go in the nats.go order and large files stream while written")
    bsub.add_parser("ls")
    bs = bsub.add_parser("seal")
    bs.add_argument("name")
    br = bsub.add_parser("rm")
    br.add_argument("name")
    br.add_argument("--force", action="store_true", help="delete even if it holds objects")

    f = sub.add_parser("fsck", help="check a bucket for orphan chunks, damaged objects and dangerous tombstones")
    f.add_argument("bucket")
    f.add_argument("--server", help="NATS URL(s) (default: $NATS_URL, else the embedded server if running)")
    f.add_argument("--repair", action="store_true",
                   help="purge orphan chunks and tombstones that carry a live object's nuid")
    f.add_argument("--verify", action="store_true", help="also read every object and check its digest")
    f.add_argument("--grace", default="5m",
                   help="chunks without a meta younger than this are a put in progress, not orphans (default 5m)")
    return p


def config_from_args(a: argparse.Namespace) -> Config:
    max_bytes = parse_size(a.max_bytes) if a.max_bytes not in ("-1", "") else -1
    return Config(
        mountpoint=a.mountpoint,
        servers=_servers(a.server),
        bucket=a.bucket,
        read_only=a.read_only,
        allow_setuid=a.allow_setuid,
        cache_dir=a.cache_dir,
        cache_size=parse_size(a.cache_size),
        spool_size=parse_size(a.spool_size),
        chunk_size=parse_size(a.chunk_size),
        max_meta_bytes=parse_size(a.max_meta_bytes),
        data_dir=a.data_dir,
        fuse_options=_fuse_opts(a.options),
        uid=os.getuid(),
        gid=os.getgid(),
        storage=a.storage,
        replicas=a.replicas,
        compression=a.compression,
        max_bytes=max_bytes,
        ttl=parse_duration(a.ttl),
        entry_timeout=parse_duration(a.entry_timeout),
        attr_timeout=parse_duration(a.entry_timeout),
        request_timeout=parse_duration(a.request_timeout),
        flush_timeout=parse_duration(a.flush_timeout) if a.flush_timeout else default_flush_timeout(_servers(a.server)),
        shutdown_timeout=parse_duration(a.shutdown_timeout),
        write_back=parse_duration(a.write_back) if a.write_back is not None else None,
    )


class PrivateLogFile(logging.handlers.WatchedFileHandler):
    """A log file only its owner can read (0600), also each time it is reopened after logrotate."""

    def _open(self) -> io.TextIOWrapper:
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, 0o600)  # a file left by an older version, or recreated by logrotate
        return open(fd, "a", encoding=self.encoding, errors=self.errors)


def private_log_dir(directory: Path) -> None:
    """Create the log directory (and missing parents) 0700; an existing directory is left as it is."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)


def _setup_logging(level: str, log_file: Path | None) -> None:
    handler: logging.Handler
    if log_file is not None:
        private_log_dir(log_file.parent)
        handler = PrivateLogFile(log_file)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper()))
    logging.getLogger("nats").setLevel(logging.WARNING)


def cmd_mount(a: argparse.Namespace) -> int:
    try:
        config = config_from_args(a)
    except ValueError as e:
        print(f"natsfs: {e}", file=sys.stderr)
        return 2
    if not a.foreground:
        return _spawn_daemon(a, config)
    if a.servers_fd is not None:
        servers = _read_servers(a.servers_fd)
        config = dataclasses.replace(config, servers=servers, flush_timeout=parse_duration(a.flush_timeout)
                                     if a.flush_timeout else default_flush_timeout(servers))
    _setup_logging(a.log_level, a.log_file)
    from .mount import MountError, serve

    ready_fd = a.ready_fd

    def on_ready() -> None:
        nonlocal ready_fd
        if ready_fd is not None:
            os.write(ready_fd, b"READY\n")
            os.close(ready_fd)
            ready_fd = None

    try:
        trio.run(serve, config, on_ready)
    except BaseException as e:
        err = single_error(e)
        if isinstance(err, KeyboardInterrupt):
            return 130
        if isinstance(err, MountError):
            message = str(err)
        else:
            log.exception("natsfs stopped on an unexpected error")
            message = f"stopped on an unexpected error: {err!r}"
        if ready_fd is not None:
            os.write(ready_fd, f"ERROR {message}\n".encode())
            os.close(ready_fd)
        else:
            print(f"natsfs: {message}", file=sys.stderr)
        return 1
    return 0


def _read_servers(fd: int) -> tuple[str, ...]:
    """The server list the parent wrote to `--servers-fd` (then closed)."""
    with os.fdopen(fd, "rb") as pipe:
        return tuple(s for s in pipe.read().decode().split("\n") if s)


def _spawn_daemon(a: argparse.Namespace, config: Config) -> int:
    """Run the mount in a detached child; return once it is live or has said why it is not."""
    from .mount import MountError, check_mountpoint

    try:
        check_mountpoint(config.mountpoint.resolve())
    except MountError as e:
        print(f"natsfs: {e}", file=sys.stderr)
        return 1
    log_dir = config.data_dir / "logs"
    log_file = a.log_file or (log_dir / (str(config.mountpoint.resolve()).strip("/").replace("/", "_") + ".log"))
    private_log_dir(log_file.parent)
    if a.log_file is None:
        log_dir.chmod(0o700)  # ours: made 0755 by versions before this one
    r, w = os.pipe()
    servers_r, servers_w = os.pipe()
    # The URLs fit in the pipe's buffer: written before the child exists, read by it at start.
    os.write(servers_w, "".join(s + "\n" for s in config.servers).encode())
    os.close(servers_w)
    args = [sys.executable, "-I", "-m", "natsfs", *_rebuild_args(a), "--foreground", "--ready-fd", str(w),
            "--servers-fd", str(servers_r), "--log-file", str(log_file)]
    with open(os.devnull, "rb") as devnull:
        subprocess.Popen(args, stdin=devnull, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         pass_fds=(w, servers_r), start_new_session=True, close_fds=True, env=child_environment())
    os.close(w)
    os.close(servers_r)
    with os.fdopen(r, "rb") as pipe:
        line = pipe.readline().decode(errors="replace").strip()
    if line == "READY":
        return 0
    if line.startswith("ERROR "):
        print(f"natsfs: {line[6:]}", file=sys.stderr)
    else:
        print(f"natsfs: the mount daemon exited before mounting (see {log_file})", file=sys.stderr)
    return 1


def _rebuild_args(a: argparse.Namespace) -> list[str]:
    out = ["mount", str(a.mountpoint.resolve())]
    simple = {"bucket": "--bucket", "cache_size": "--cache-size",
              "spool_size": "--spool-size", "chunk_size": "--chunk-size", "max_meta_bytes": "--max-meta-bytes",
              "storage": "--storage", "max_bytes": "--max-bytes", "ttl": "--ttl", "log_level": "--log-level",
              "entry_timeout": "--entry-timeout", "flush_timeout": "--flush-timeout",
              "request_timeout": "--request-timeout",
              "shutdown_timeout": "--shutdown-timeout", "write_back": "--write-back"}
    for attr, flag in simple.items():
        value = getattr(a, attr)
        if value is not None:
            out += [flag, str(value)]
    out += ["--cache-dir", str(a.cache_dir), "--data-dir", str(a.data_dir), "--replicas", str(a.replicas)]
    if a.read_only:
        out.append("--read-only")
    if a.compression:
        out.append("--compression")
    if a.allow_setuid:
        out.append("--allow-setuid")
    for o in a.options or []:
        out += ["-o", o]
    return out


def cmd_umount(a: argparse.Namespace) -> int:
    """Unmount; when files are still open, ask the daemon (SIGTERM) to store what is open for
    writing and unmount, and wait for it (its own wait is bounded by --shutdown-timeout)."""
    target = _outside_path(a.mountpoint)
    write_back = _write_back_progress(target)
    proc = subprocess.run(["fusermount3", "-u", str(a.mountpoint)], capture_output=True, text=True)
    if proc.returncode == 0:
        _print_write_back_progress(write_back)
        return 0
    msg = (proc.stderr.strip().splitlines() or ["unmount failed"])[-1]
    daemons = _daemons_of(target) if "busy" in msg.lower() else []
    if not daemons:
        print(f"natsfs: {msg}", file=sys.stderr)
        return 1
    print(f"natsfs: {target} is busy; the daemon stores the files open for writing, then unmounts",
          file=sys.stderr)
    for pid in daemons:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError as e:
            print(f"natsfs: cannot signal the daemon (pid {pid}): {e.strerror}", file=sys.stderr)
            return 1
    while _is_mounted(target) and any(_alive(pid) for pid in daemons):
        time.sleep(0.1)
    _print_write_back_progress(write_back)
    if _is_mounted(target):
        print(f"natsfs: {target} is still mounted", file=sys.stderr)
        return 1
    return 0


def _write_back_progress(target: str) -> list[tuple[int, Path]]:
    """(pid, progress file) of each daemon of `target` mounted with --write-back: after the unmount it
    uploads what is still queued and writes its progress there (natsfs.core.writeback)."""
    from .compose import spool_root  # the mount's modules, only when unmounting
    from .core.writeback import PROGRESS_FILE

    found = []
    for pid in _daemons_of(target):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [os.fsdecode(x) for x in f.read().split(b"\0")]
        except OSError:
            continue
        if not any(x == "--write-back" or x.startswith("--write-back=") for x in argv):
            continue
        cache_dir = cfg.default_cache_dir()
        for i, x in enumerate(argv):
            if x == "--cache-dir" and i + 1 < len(argv):
                cache_dir = Path(argv[i + 1])
            elif x.startswith("--cache-dir="):
                cache_dir = Path(x.split("=", 1)[1])
        found.append((pid, spool_root(cache_dir, Path(target)) / PROGRESS_FILE))
    return found


def _print_write_back_progress(daemons: list[tuple[int, Path]]) -> None:
    """Wait for write-back daemons to finish their uploads and exit, printing each progress line once."""
    last = ""
    if daemons:
        print("natsfs: waiting for pending write-back uploads", file=sys.stderr)
    while any(_alive(pid) for pid, _ in daemons):
        for _, progress in daemons:
            try:
                text = progress.read_text().strip()
            except OSError:
                continue
            if text and text != last:
                print(f"natsfs: {text}", file=sys.stderr)
                last = text
        time.sleep(0.1)


def _outside_path(path: Path) -> str:
    """The absolute path of a mountpoint, resolving only its parent (never stat the mount itself)."""
    absolute = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(absolute)), os.path.basename(absolute))


def _is_mounted(target: str) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1].replace("\\040", " ") == target for line in f)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _daemons_of(target: str) -> list[int]:
    """Processes running `natsfs mount TARGET --foreground` (the daemon of that mount)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = [os.fsdecode(x) for x in f.read().split(b"\0")]
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:
            continue
        if "--foreground" not in argv or "mount" not in argv or not any("natsfs" in x for x in argv):
            continue
        i = argv.index("mount")
        if i + 1 < len(argv) and _outside_path(Path(os.path.join(cwd, argv[i + 1]))) == target:
            found.append(int(entry))
    return found


def cmd_bucket(a: argparse.Namespace) -> int:
    from .tools import bucket_command

    try:
        return trio.run(bucket_command, a)
    except BaseException as e:
        err = single_error(e)
        from .errors import NatsFSError

        if isinstance(err, NatsFSError):
            print(f"natsfs: {err}", file=sys.stderr)
            return 1
        raise


def cmd_fsck(a: argparse.Namespace) -> int:
    """Exit 0: clean or repaired; 1: problems remain; 2: the check could not run."""
    from .errors import NatsFSError
    from .tools import fsck_command

    try:
        return trio.run(fsck_command, a)
    except BaseException as e:
        err = single_error(e)
        if isinstance(err, NatsFSError):
            print(f"natsfs fsck: {err}", file=sys.stderr)
            return 2
        raise


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    handlers: dict[str, Any] = {"mount": cmd_mount, "umount": cmd_umount, "bucket": cmd_bucket,
                                "fsck": cmd_fsck}
    return int(handlers[a.command](a))


if __name__ == "__main__":
    sys.exit(main())
