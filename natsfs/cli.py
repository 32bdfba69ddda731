"""Command line: `natsfs mount|umount|bucket ...`, option parsing, exit codes, one-sentence errors.

`natsfs mount` without `--foreground` starts the daemon as a child process and waits until it
reports the mount live (exit 0) or reports why it could not start (exit 1, one sentence). The child
reports over a pipe named by the hidden `--ready-fd` option.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio

from . import config as cfg
from .config import Config, parse_duration, parse_size

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
    m.add_argument("-o", dest="options", action="append", help="FUSE mount options (comma separated)")
    m.add_argument("--storage", choices=("file", "memory"), default="file", help="storage of new buckets")
    m.add_argument("--replicas", type=int, default=1, help="replicas of new buckets")
    m.add_argument("--compression", action="store_true", help="compress new buckets (s2)")
    m.add_argument("--max-bytes", default="-1", help="size limit of new buckets (-1: none)")
    m.add_argument("--ttl", default="0", help="object TTL of new buckets (e.g. 7d; 0: none)")
    m.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    m.add_argument("--log-file", type=Path, help="log here (default: stderr in the foreground)")
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)

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
    bsub.add_parser("ls")
    bs = bsub.add_parser("seal")
    bs.add_argument("name")
    br = bsub.add_parser("rm")
    br.add_argument("name")
    br.add_argument("--force", action="store_true", help="delete even if it holds objects")
    return p


def config_from_args(a: argparse.Namespace) -> Config:
    max_bytes = parse_size(a.max_bytes) if a.max_bytes not in ("-1", "") else -1
    return Config(
        mountpoint=a.mountpoint,
        servers=_servers(a.server),
        bucket=a.bucket,
        read_only=a.read_only,
        cache_dir=a.cache_dir,
        cache_size=parse_size(a.cache_size),
        spool_size=parse_size(a.spool_size),
        chunk_size=parse_size(a.chunk_size),
        max_meta_bytes=parse_size(a.max_meta_bytes),
        request_timeout=parse_duration(a.request_timeout),
        data_dir=a.data_dir,
        fuse_options=_fuse_opts(a.options),
        uid=os.getuid(),
        gid=os.getgid(),
        storage=a.storage,
        replicas=a.replicas,
        compression=a.compression,
        max_bytes=max_bytes,
        ttl=parse_duration(a.ttl),
    )


def _setup_logging(level: str, log_file: Path | None) -> None:
    handler: logging.Handler
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(log_file)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper()))
    logging.getLogger("nats").setLevel(logging.WARNING)


def _single_error(exc: BaseException) -> BaseException:
    """The one exception inside (possibly nested) exception groups, else the group itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def cmd_mount(a: argparse.Namespace) -> int:
    try:
        config = config_from_args(a)
    except ValueError as e:
        print(f"natsfs: {e}", file=sys.stderr)
        return 2
    if not a.foreground:
        return _spawn_daemon(a, config)
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
        err = _single_error(e)
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


def _spawn_daemon(a: argparse.Namespace, config: Config) -> int:
    """Run the mount in a detached child; return once it is live or has said why it is not."""
    from .mount import MountError, check_mountpoint

    try:
        check_mountpoint(config.mountpoint.resolve())
    except MountError as e:
        print(f"natsfs: {e}", file=sys.stderr)
        return 1
    log_file = a.log_file or (config.data_dir / "logs" /
                              (str(config.mountpoint.resolve()).strip("/").replace("/", "_") + ".log"))
    log_file.parent.mkdir(parents=True, exist_ok=True)
    r, w = os.pipe()
    args = [sys.executable, "-m", "natsfs", *_rebuild_args(a), "--foreground", "--ready-fd", str(w),
            "--log-file", str(log_file)]
    with open(os.devnull, "rb") as devnull:
        subprocess.Popen(args, stdin=devnull, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         pass_fds=(w,), start_new_session=True, close_fds=True)
    os.close(w)
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
    simple = {"server": "--server", "bucket": "--bucket", "cache_size": "--cache-size",
              "spool_size": "--spool-size", "chunk_size": "--chunk-size", "max_meta_bytes": "--max-meta-bytes",
              "request_timeout": "--request-timeout", "storage": "--storage", "max_bytes": "--max-bytes",
              "ttl": "--ttl", "log_level": "--log-level"}
    for attr, flag in simple.items():
        value = getattr(a, attr)
        if value is not None:
            out += [flag, str(value)]
    out += ["--cache-dir", str(a.cache_dir), "--data-dir", str(a.data_dir), "--replicas", str(a.replicas)]
    if a.server is None and os.environ.get("NATS_URL"):
        out += ["--server", os.environ["NATS_URL"]]
    if a.read_only:
        out.append("--read-only")
    if a.compression:
        out.append("--compression")
    for o in a.options or []:
        out += ["-o", o]
    return out


def cmd_umount(a: argparse.Namespace) -> int:
    proc = subprocess.run(["fusermount3", "-u", str(a.mountpoint)], capture_output=True, text=True)
    if proc.returncode != 0:
        msg = (proc.stderr.strip().splitlines() or ["unmount failed"])[-1]
        print(f"natsfs: {msg}", file=sys.stderr)
        return 1
    return 0


def cmd_bucket(a: argparse.Namespace) -> int:
    from .tools import bucket_command

    try:
        return trio.run(bucket_command, a)
    except BaseException as e:
        err = _single_error(e)
        from .errors import NatsFSError

        if isinstance(err, NatsFSError):
            print(f"natsfs: {err}", file=sys.stderr)
            return 1
        raise


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    handlers: dict[str, Any] = {"mount": cmd_mount, "umount": cmd_umount, "bucket": cmd_bucket}
    return int(handlers[a.command](a))


if __name__ == "__main__":
    sys.exit(main())
