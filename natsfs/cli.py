"""Command line: `natsfs mount|umount|status|bucket|fsck ...`, option parsing, exit codes, one-sentence errors.

The mount options are generated from `Config` (config.py `option` fields) plus the connection options
(auth.py); each is also `-o key=value`, and mount(8)'s form `natsfs SOURCE MOUNTPOINT -o OPTIONS` (as
mount.fuse3 runs it for `-t fuse.natsfs`) is turned into `natsfs mount` first.

`natsfs mount` without `--foreground` starts the daemon as a child process with the user's own
arguments (less the connection options) and waits until it reports the mount live (exit 0) or reports
why it could not start (exit 1, one sentence). The child reports over a pipe named by the hidden
`--ready-fd` option. The child runs isolated (`python -I`), and the connection settings (server URLs
and credentials, which may be secret) reach it through another pipe (`--servers-fd`), never on its
command line or in its environment.

The daemon's log file is created 0600 in a directory created 0700, and is reopened when logrotate
moves it away.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import io
import json
import logging
import logging.handlers
import os
import re
import signal
import stat
import subprocess
import sys
import time
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from . import auth, sdnotify, status
from . import config as cfg
from .config import Config, default_flush_timeout
from .errors import NatsFSError, single_error
from .secrecy import child_environment, private_dir, redact_url

log = logging.getLogger("natsfs")


COMMANDS = ("mount", "umount", "bucket", "status", "fsck")
# Mount options mount(8) and fstab use that mean something only to mount(8), systemd or mount.fuse3.
# (mount.fuse3 adds "dev,suid" to what fstab says; those, "rw", "exec", "atime" and "async" are the defaults.)
IGNORED_MOUNT_OPTIONS = frozenset({"rw", "defaults", "auto", "noauto", "user", "nouser", "users", "owner",
                                   "_netdev", "nofail", "dev", "suid", "exec", "atime", "async"})
IGNORED_MOUNT_PREFIXES = ("x-", "comment=", "setuid=", "drop_privileges")
# Generic mount flags and FUSE options passed to the kernel (through libfuse) as they are.
KERNEL_MOUNT_OPTIONS = frozenset({"allow_other", "allow_root", "default_permissions", "auto_unmount", "nosuid",
                                  "nodev", "noexec", "sync", "dirsync", "noatime", "nodiratime", "relatime"})
# Mount options that name another option. mount(8) drops `user=NAME` from a non-root user's mount of a
# `users` fstab line before it runs the helper (util-linux 2.38, checked with a probe helper), so fstab
# names the NATS user `nats_user=NAME`; `user=NAME` still works where root mounts.
MOUNT_OPTION_ALIASES = {"nats_user": "user"}
# Hidden plumbing options that `-o` must not reach.
_PRIVATE_DESTS = frozenset({"ready_fd", "servers_fd", "help"})


def source_arguments(source: str) -> list[str]:
    """The mount(8) SOURCE as options: `nats://host:4222[,nats://host2:4222][/bucket]` gives --server (and
    --bucket); a SOURCE without `://` (e.g. `natsfs`) names no server ($NATS_URL, the NATS context or the
    embedded server then)."""
    if "://" not in source:
        return []
    servers, _, bucket = source.rpartition("://")[2].partition("/")
    head = source[: len(source) - len(source.rpartition("://")[2])]
    out = ["--server", head + servers]
    if bucket.strip("/"):
        out += ["--bucket", bucket.strip("/")]
    return out


def _split_mount_options(argv: list[str]) -> tuple[list[str], list[str]]:
    """`argv` without its `-o A,B` / `-oA,B` arguments, and the single options they held."""
    rest: list[str] = []
    options: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-o" and i + 1 < len(argv):
            options.extend(o.strip() for o in argv[i + 1].split(",") if o.strip())
            i += 2
            continue
        if arg.startswith("-o") and arg != "-o":
            options.extend(o.strip() for o in arg[2:].split(",") if o.strip())
        else:
            rest.append(arg)
        i += 1
    return rest, options


def expand_mount_options(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`-o key=value,flag` as the options `--key value --flag`; kernel/FUSE options stay `-o`, the
    fstab-only ones are dropped, anything else is an error (`parser.error`)."""
    rest, options = _split_mount_options(argv)
    # By dest (creds_file) and by flag (creds for --creds, cache_dir for --cache-dir).
    actions = {a.dest: a for a in parser._actions if a.dest not in _PRIVATE_DESTS and a.option_strings}
    actions |= {flag.lstrip("-").replace("-", "_"): a for a in list(actions.values()) for flag in a.option_strings
                if flag.startswith("--")}
    expanded: list[str] = []
    kernel: list[str] = []
    for option in options:
        key, has_value, value = option.partition("=")
        if has_value and key in MOUNT_OPTION_ALIASES:
            key = MOUNT_OPTION_ALIASES[key]
        if key in KERNEL_MOUNT_OPTIONS and not has_value:
            kernel.append(key)
        elif key == "ro" and not has_value:
            expanded.append("--read-only")
        elif key in ("password", "token"):
            parser.error(f"{key} cannot be a mount option (every user sees those in the process list): "
                         f"use {key}_file=FILE or $NATS_{key.upper()}")
        elif key in ("server", "servers") and _has_secret(value):
            parser.error("a server URL with a password or token cannot be a mount option (every user sees "
                         "those in the process list): use nats_user=NAME with password_file=FILE, or token_file=FILE")
        elif (key in IGNORED_MOUNT_OPTIONS and not (has_value and key == "user")) \
                or option.startswith(IGNORED_MOUNT_PREFIXES):
            # (mount(8)'s bare `user` flag is dropped; `user=NAME`, like `nats_user=NAME`, is the NATS user)
            continue
        elif key in actions and actions[key].option_strings:
            action = actions[key]
            flag = action.option_strings[-1]
            if action.nargs == 0:
                if has_value:
                    parser.error(f"mount option {key} takes no value")
                expanded.append(flag)
            elif not has_value and action.nargs == "?":
                expanded.append(f"{flag}={action.const}")  # (a bare flag would take the mountpoint)
            elif not has_value:
                parser.error(f"mount option {key} needs a value ({key}=...)")
            else:
                expanded += [flag, value]
        elif "@" in option:  # (the rest of a server URL cut at a comma of its password: never shown)
            parser.error("a server URL with a password or token cannot be a mount option (every user sees "
                         "those in the process list): use nats_user=NAME with password_file=FILE, or token_file=FILE")
        else:
            parser.error(f"unknown mount option: {key}")
    kernel_args = ["-o", ",".join(kernel)] if kernel else []
    return expanded + rest + kernel_args


# mount(8)'s SOURCE is in every user's process list while mounting (mount.fuse3's argv and ours) and in
# /etc/fstab, which every user reads: credentials there are refused as they are in `-o server=`. An `@`
# is in no host name or bucket name: a SOURCE holding one carries a userinfo.
SECRET_IN_SOURCE = ("the mount SOURCE cannot carry a user, password or token (every user sees it in the process "
                    "list and in /etc/fstab): use nats_user=NAME with password_file=FILE, token_file=FILE, creds=FILE, "
                    "or $NATS_USER/$NATS_PASSWORD/$NATS_TOKEN in a systemd environment file")


def _has_secret(servers: str) -> bool:
    """Whether a comma list of server URLs carries a password or token in one of its userinfos."""
    return any(redact_url(url.strip()) != url.strip() for url in servers.split(","))


def normalize_argv(argv: list[str]) -> list[str]:
    """mount(8)'s form `natsfs SOURCE MOUNTPOINT [-o OPTIONS]` (as mount.fuse3 runs it) as `natsfs mount`."""
    if len(argv) >= 2 and argv[0] not in COMMANDS and not argv[0].startswith("-") \
            and not argv[1].startswith("-"):
        return ["mount", argv[1], *source_arguments(argv[0]), *argv[2:]]
    return argv


class OneSentenceParser(argparse.ArgumentParser):
    """Refused arguments are one sentence (`natsfs: ...`), not the usage block first."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"natsfs: {message}\n")


def _typed(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse `type` from a config.py parser: its ValueError's text is what argparse says."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return convert


def build_parser() -> argparse.ArgumentParser:
    p = OneSentenceParser(prog="natsfs", description="Mount NATS JetStream Object Store buckets.")
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("mount", help="mount buckets on a directory")
    m.add_argument("mountpoint", type=Path)
    auth.add_options(m)
    m.add_argument("--foreground", action="store_true", help="stay in the foreground until unmounted")
    add_config_options(m)
    m.add_argument("-o", dest="options", action="append",
                   help="mount options, comma separated: any option here as key=value (cache_dir=/x), ro, "
                        "allow_other, default_permissions and other FUSE/kernel options; _netdev, nofail, "
                        "x-systemd.* are for mount(8)/systemd and ignored")
    m.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    m.add_argument("--log-file", type=Path,
                   help="log to this file, or `-` for stderr (the journal under systemd); default: stderr in "
                        "the foreground, else DATA_DIR/logs/MOUNTPOINT.log")
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    m.add_argument("--servers-fd", type=int, help=argparse.SUPPRESS)

    u = sub.add_parser("umount", help="unmount a natsfs mount")
    u.add_argument("mountpoint", type=Path)

    st = sub.add_parser("status", help="show what the daemon of a mount is doing")
    st.add_argument("mountpoint", type=Path, nargs="?", help="a natsfs mount (default: every natsfs mount)")
    st.add_argument("--json", action="store_true", help="print the daemon's figures as JSON")
    st.add_argument("--prometheus", action="store_true",
                    help="print Prometheus text metrics (for node_exporter's textfile collector)")

    b = sub.add_parser("bucket", help="manage buckets")
    auth.add_options(b, suppress=True)
    bsub = b.add_subparsers(dest="bucket_command", required=True)
    bc = bsub.add_parser("create")
    bc.add_argument("name")
    bc.add_argument("--description", default="")
    bc.add_argument("--storage", choices=("file", "memory"), default="file")
    bc.add_argument("--replicas", type=_typed(cfg.parse_integer), default=1)
    bc.add_argument("--compression", action="store_true")
    bc.add_argument("--max-bytes", type=_typed(cfg.parse_bytes_limit), default="-1")
    bc.add_argument("--ttl", type=_typed(cfg.parse_duration), default="0")
    bc.add_argument("--no-atomic", action="store_true",
                    help="no atomic batches: puts go in the nats.go order and large files stream while written")
    bl = bsub.add_parser("ls")
    bs = bsub.add_parser("seal")
    bs.add_argument("name")
    br = bsub.add_parser("rm")
    br.add_argument("name")
    br.add_argument("--force", action="store_true", help="delete even if it holds objects")
    for leaf in (bc, bl, bs, br):  # the connection options also after the subcommand
        auth.add_options(leaf, suppress=True)

    f = sub.add_parser("fsck", help="check a bucket for orphan chunks, damaged objects and dangerous tombstones")
    f.add_argument("bucket")
    auth.add_options(f)
    f.add_argument("--repair", action="store_true",
                   help="purge orphan chunks and tombstones that carry a live object's nuid")
    f.add_argument("--verify", action="store_true", help="also read every object and check its digest")
    f.add_argument("--grace", type=_typed(cfg.parse_duration), default="5m",
                   help="chunks without a meta younger than this are a put in progress, not orphans (default 5m)")
    return p


def add_config_options(parser: argparse.ArgumentParser) -> None:
    """One option per `Config` option field (config.py `option`): `--name-with-dashes`, its help and
    default from the field; absent options stay None, so `config_from_args` keeps the field's default."""
    for f in cfg.option_fields():
        flag = "--" + f.name.replace("_", "-")
        default = f.metadata["shown"] or (f.default if f.default is not dataclasses.MISSING else None)
        text = f.metadata["help"]
        if f.type in (bool, "bool"):
            parser.add_argument(flag, dest=f.name, action="store_true", default=None, help=text)
        elif f.metadata["optional"] is not None:
            metavar = "DELAY" if f.metadata["parse"] is cfg.parse_duration else "VALUE"
            parser.add_argument(flag, dest=f.name, nargs="?", const=f.metadata["optional"], metavar=metavar,
                                help=f"{text} (default: {default})")
        else:
            parser.add_argument(flag, dest=f.name, choices=f.metadata["choices"],
                                help=f"{text} (default: {default})" if default not in (None, "") else text)


def connection_from_args(a: argparse.Namespace) -> auth.Connection:
    """The connection settings the options name (with the environment and the NATS context)."""
    return auth.resolve({name: getattr(a, name, None) for name in auth.OPTION_DESTS})


def config_from_args(a: argparse.Namespace, connection: auth.Connection) -> Config:
    """A `Config` from the parsed options: each given option parsed by its field's `parse`."""
    values: dict[str, Any] = {"uid": os.getuid(), "gid": os.getgid()}
    for f in cfg.option_fields():
        given = getattr(a, f.name, None)
        if given is None:
            continue
        parse = f.metadata["parse"]
        try:
            values[f.name] = parse(given) if parse is not None else given
            cfg.check_bounds(f.name, values[f.name], f.metadata["bounds"])
        except ValueError as e:
            raise ValueError(f"--{f.name.replace('_', '-')}: {e}") from None
    if "entry_timeout" in values:
        values["attr_timeout"] = values["entry_timeout"]
    if "flush_timeout" not in values:
        values["flush_timeout"] = default_flush_timeout(connection.servers)
    return Config(mountpoint=a.mountpoint, servers=connection.servers, credentials=connection,
                  fuse_options=tuple(o for v in a.options or [] for o in v.split(",") if o), **values)


class PrivateLogFile(logging.handlers.WatchedFileHandler):
    """A log file only its owner can read (0600), also each time it is reopened after logrotate."""

    def _open(self) -> io.TextIOWrapper:
        # Never through a symlink, and never another user's file: whoever can write the log directory
        # could otherwise have the daemon append to (and chmod) a file of their choosing.
        try:
            fd = os.open(self.baseFilename,
                         os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                         0o600)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise OSError(e.errno, "it is a symlink", self.baseFilename) from None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            raise OSError(errno.EPERM, "it is not this user's own regular file", self.baseFilename)
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o600)  # a file left by an older version, or recreated by logrotate
        os.set_blocking(fd, True)
        return open(fd, "a", encoding=self.encoding, errors=self.errors)

    # Why the log path could not be reopened (None while it is the file written to).
    _refused: str | None = None

    def reopenIfNeeded(self) -> None:
        """Reopen the log path when the file was moved or deleted; if it cannot be opened now (its directory
        removed, a symlink or another user's file put there), keep writing to the old file and try again at
        the next record. (The stock handler would raise out of the logging call: in the FUSE thread that
        ends the daemon, with nothing logged anywhere.) Said once in the old file when refused, and once in
        the new one when the path opens again."""
        try:
            sres: os.stat_result | None = os.stat(self.baseFilename)
        except OSError:
            sres = None
        if sres is not None and self.stream is not None and (sres.st_dev, sres.st_ino) == (self.dev, self.ino):
            return
        try:
            stream = self._open()
        except OSError as e:
            if self._refused is None:
                self._refused = e.strerror or str(e)
                self._note(f"cannot reopen the log file {self.baseFilename} ({self._refused}): logging to the "
                           "file it was until it can")
            return
        old, self.stream = self.stream, stream
        if old is not None:
            with contextlib.suppress(OSError, ValueError):
                old.close()
        self._statstream()
        if self._refused is not None:
            self._note(f"reopened the log file {self.baseFilename}; earlier lines went to the file it was before "
                       f"(it could not be reopened: {self._refused})")
            self._refused = None

    def _note(self, text: str) -> None:
        """One line of the handler's own in the file it writes to now (if any, and if it takes it)."""
        if self.stream is None:
            return
        record = logging.LogRecord("natsfs", logging.WARNING, __file__, 0, text, None, None)
        with contextlib.suppress(OSError, ValueError):
            self.stream.write(self.format(record) + self.terminator)
            self.stream.flush()

    def emit(self, record: logging.LogRecord) -> None:
        self.reopenIfNeeded()
        if self.stream is None:
            return  # (never opened again since: the line is dropped; the next record tries again)
        logging.StreamHandler.emit(self, record)




class UndeliveredReplies(logging.Filter):
    """pyfuse3 logs an ERROR when writing a reply to /dev/fuse fails. With ENOENT that only means the
    kernel no longer waits for that reply: the connection ended (the filesystem was unmounted, or
    aborted) while the daemon served a request no caller waits for (a readahead read, the release
    after a close). The daemon still did the request's work, so this is one DEBUG line. (A caller
    interrupted by a signal does not cause it: the kernel waits for the answer of a request the daemon
    has read, even for SIGKILL.) Any other errno stays an ERROR."""

    _FAILED = re.compile(r"(?P<op>fuse_\w+\(\)): fuse_reply_\* failed with %s")
    _ENOENT = os.strerror(errno.ENOENT)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.ERROR or record.args != (self._ENOENT,):
            return True
        failed = self._FAILED.fullmatch(str(record.msg))
        if failed is None:
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        record.msg = "%s: the kernel no longer waits for this reply (%s: the connection ended meanwhile)"
        record.args = (failed["op"], self._ENOENT)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


UNDELIVERED_REPLIES = UndeliveredReplies()


def _setup_logging(level: str, log_file: Path | None) -> None:
    handler: logging.Handler
    if log_file is not None:
        private_dir(log_file.parent)
        handler = PrivateLogFile(log_file)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler, status.RecentProblems()]
    root.setLevel(getattr(logging, level.upper()))
    logging.getLogger("nats").setLevel(logging.WARNING)
    logging.getLogger("pyfuse3").addFilter(UNDELIVERED_REPLIES)


def _mount_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `mount` subcommand's parser within `build_parser()`'s."""
    subparsers = next(act for act in parser._actions if isinstance(act, argparse._SubParsersAction))
    return subparsers.choices["mount"]


def cmd_mount(a: argparse.Namespace) -> int:
    try:
        if a.servers_fd is not None:
            connection = _read_connection(a.servers_fd)
        else:
            connection = connection_from_args(a)
            connection.check_files()
        config = config_from_args(a, connection)
    except (ValueError, NatsFSError) as e:
        print(f"natsfs: {e}", file=sys.stderr)
        return 2
    log_file = None if a.log_file == Path("-") else a.log_file
    problem = check_local_paths(config, log_file)
    if problem is not None:
        print(f"natsfs: {problem}", file=sys.stderr)
        return 2
    if not a.foreground:
        return _spawn_daemon(a, config)
    try:
        _setup_logging(a.log_level, None if a.log_file == Path("-") else a.log_file)
    except OSError as e:
        print(f"natsfs: cannot open the log file {e.filename}: {e.strerror}", file=sys.stderr)
        return 1
    from .mount import MountError, serve

    ready_fd = a.ready_fd

    def on_ready() -> None:
        nonlocal ready_fd
        sdnotify.notify("READY=1", f"STATUS=serving {config.mountpoint}")
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
        sdnotify.notify(f"STATUS={message}")
        if ready_fd is not None:
            os.write(ready_fd, f"ERROR {message}\n".encode())
            os.close(ready_fd)
        else:
            print(f"natsfs: {message}", file=sys.stderr)
        return 1
    return 0


def check_local_paths(config: Config, log_file: Path | None) -> str | None:
    """Why the local paths of a mount cannot be used (one sentence), or None: a cache, data or log path
    inside the mountpoint (the daemon would wait on its own mount: the log handler stats its path at
    every line, from the thread that serves FUSE), or a file where a directory must be."""
    mountpoint = os.path.realpath(config.mountpoint)
    named = [("--cache-dir", config.cache_dir), ("--data-dir", config.data_dir)]
    if log_file is not None:
        named.append(("--log-file", log_file))
    for flag, path in named:
        real = os.path.realpath(path)  # (through symlinks: a link out of the mount is fine, into it is not)
        if real == mountpoint or real.startswith(mountpoint.rstrip("/") + "/"):
            return (f"{flag} {path} is inside the mountpoint {mountpoint}: the daemon would wait on its own "
                    "mount; choose a path outside it")
    for flag, path in named:
        blocker = _file_in_the_way(path.parent if flag == "--log-file" else path)
        if blocker is not None:
            return f"{flag} {path} cannot be used: {blocker} is not a directory"
    return None


def _file_in_the_way(directory: Path) -> Path | None:
    """The nearest existing path of `directory` and its parents if it is not a directory (so `directory`
    cannot be created or used), else None."""
    for path in (directory, *directory.parents):
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:
            return None  # (said, with its reason, where it is used)
        return None if stat.S_ISDIR(st.st_mode) else path
    return None


def _read_connection(fd: int) -> auth.Connection:
    """The connection settings the parent wrote to `--servers-fd` (then closed)."""
    with os.fdopen(fd, "rb") as pipe:
        return auth.Connection.from_json(pipe.read())


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
    if log_file != Path("-"):
        try:  # the daemon's own check, said here where the user sees it
            private_dir(log_file.parent)
            PrivateLogFile(log_file).close()
        except OSError as e:
            print(f"natsfs: cannot open the log file {e.filename}: {e.strerror}", file=sys.stderr)
            return 1
    if a.log_file is None:
        log_dir.chmod(0o700)  # ours: made 0755 by versions before this one
    r, w = os.pipe()
    servers_r, servers_w = os.pipe()
    # The settings fit in the pipe's buffer: written before the child exists, read by it at start.
    os.write(servers_w, config.credentials.to_json().encode())
    os.close(servers_w)
    args = [sys.executable, "-I", "-m", "natsfs", *daemon_arguments(a.argv, a.mountpoint,
                                                                      str(config.mountpoint.resolve())),
            "--foreground", "--ready-fd", str(w), "--servers-fd", str(servers_r), "--log-file", str(log_file)]
    stderr = None if log_file == Path("-") else subprocess.DEVNULL
    with open(os.devnull, "rb") as devnull:
        subprocess.Popen(args, stdin=devnull, stdout=subprocess.DEVNULL, stderr=stderr,
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


def daemon_arguments(argv: list[str], given: Path | None, mountpoint: str) -> list[str]:
    """The user's own `natsfs mount` arguments (after `-o` expansion) for the daemon, with the mountpoint
    made absolute and without the connection options: those reach it through a pipe (secrets never go
    into argv) and `--log-file`, which the parent sets."""
    parser = build_parser()
    mount_parser = next(act for act in parser._actions if isinstance(act, argparse._SubParsersAction)).choices["mount"]
    takes_value = {flag: act.nargs for act in mount_parser._actions for flag in act.option_strings}
    dropped = {flag for act in mount_parser._actions if act.dest in (*auth.OPTION_DESTS, "log_file")
               for flag in act.option_strings}
    out = ["mount", mountpoint]
    rest = argv[1:]  # after "mount"
    i = 0
    while i < len(rest):
        arg = rest[i]
        flag, inline, _ = arg.partition("=")
        nargs = takes_value.get(flag, 0)
        consumes = nargs != 0 and not inline and arg.startswith("-") and not (
            nargs == "?" and (i + 1 >= len(rest) or rest[i + 1].startswith("-")))
        if given is not None and not arg.startswith("-") and Path(arg) == given:
            given = None  # the positional mountpoint, given absolute above
            i += 1
            continue
        if flag in dropped:
            i += 2 if consumes else 1
            continue
        out.append(arg)
        if consumes and i + 1 < len(rest):
            out.append(rest[i + 1])
            i += 1
        i += 1
    return out


def cmd_umount(a: argparse.Namespace) -> int:
    """Unmount; when files are still open, ask the daemon (SIGTERM) to store what is open for
    writing and unmount, and wait for it (its own wait is bounded by --shutdown-timeout)."""
    # A symlink to the mount: its target (readlink and the parents only, never a stat through the mount).
    target = os.path.realpath(a.mountpoint) if os.path.islink(a.mountpoint) else _outside_path(a.mountpoint)
    kind = _mount_type(target)
    if kind is None or not kind.endswith("natsfs"):
        shown = "" if kind is None else f" (it is a {kind} mount)"
        print(f"natsfs: {target} is not a natsfs mount{shown}", file=sys.stderr)
        return 1
    write_back = _write_back_progress(target)
    proc = subprocess.run(["fusermount3", "-u", target], capture_output=True, text=True)
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
    """(pid, progress file) of each daemon of `target` mounted in write-back mode: after the unmount it
    uploads what is still queued and writes its progress there (natsfs.core.writeback)."""
    found = []
    for pid in _daemons_of(target):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [os.fsdecode(x) for x in f.read().split(b"\0") if x]
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        progress = write_back_progress_file(argv, cwd, target)
        if progress is not None:
            found.append((pid, progress))
    return found


def write_back_progress_file(argv: list[str], cwd: str, target: str) -> Path | None:
    """Where a daemon run as `argv` (its command line, from `cwd`) writes its write-back progress, or None
    if it is not in write-back mode. Its options are read by the parser it read them with itself, so
    `-o write_back,cache_dir=...` (natsfs@.service, fstab) counts as much as `--write-back`."""
    from .compose import spool_root  # the mount's modules, only when unmounting
    from .core.writeback import PROGRESS_FILE

    if "mount" not in argv:
        return None
    args = argv[argv.index("mount") + 1:]
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # (a parse error is not ours to print)
            mount_parser = _mount_parser(build_parser())
            a = mount_parser.parse_args(expand_mount_options(mount_parser, args))
        config = config_from_args(a, auth.Connection())
    except (SystemExit, ValueError):
        return None
    if config.write_back is None:
        return None
    return spool_root(Path(cwd) / config.cache_dir, Path(target)) / PROGRESS_FILE


def _print_write_back_progress(daemons: list[tuple[int, Path]]) -> None:
    """Wait for write-back daemons to finish their uploads and exit, printing each progress line once."""
    last = ""
    if daemons:
        print("natsfs: waiting for pending write-back uploads", file=sys.stderr)
    running = True
    while running:
        running = any(_alive(pid) for pid, _ in daemons)
        # (One more pass after the daemons exited: the last line may be written just before the exit.)
        for _, progress in daemons:
            try:
                text = progress.read_text().strip()
            except OSError:
                continue
            if text and text != last:
                print(f"natsfs: {text}", file=sys.stderr)
                last = text
        if running:
            time.sleep(0.1)


def _outside_path(path: Path) -> str:
    """The absolute path of a mountpoint, resolving only its parent (never stat the mount itself)."""
    absolute = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(absolute)), os.path.basename(absolute))


def _mount_type(target: str) -> str | None:
    """The type of the last mount on `target` in /proc/self/mounts (`fuse.natsfs`), None if none."""
    found = None
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 2 and fields[1].replace("\\040", " ") == target:
                found = fields[2]
    return found


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


def cmd_status(a: argparse.Namespace) -> int:
    """Print what the daemon of each named (or every) natsfs mount reports (see natsfs/status.py)."""
    targets = [_outside_path(a.mountpoint)] if a.mountpoint is not None else status.natsfs_mounts()
    if not targets:
        print("natsfs: no natsfs mounts", file=sys.stderr)
        return 1
    failed = 0
    for target in targets:
        try:
            stats = status.read_stats(target)
        except (OSError, TimeoutError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            print(f"natsfs: cannot read the status of {target}: {reason}", file=sys.stderr)
            failed = 1
            continue
        if a.json:
            print(json.dumps(stats, indent=2))
        elif a.prometheus:
            print(status.prometheus_text(target, stats))
        else:
            print(status.format_status(target, stats))
    sys.stdout.flush()
    if failed and a.mountpoint is not None:
        os._exit(1)  # a thread may still wait on a daemon that does not answer
    return failed


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
    parser = build_parser()
    given = list(sys.argv[1:] if argv is None else argv)
    argv = normalize_argv(given)
    if argv and argv[0] == "mount":
        mount_parser = next(act for act in parser._actions
                            if isinstance(act, argparse._SubParsersAction)).choices["mount"]
        if argv != given and "@" in given[0]:  # mount(8)'s form, its SOURCE with a userinfo
            mount_parser.error(SECRET_IN_SOURCE)
        argv = [argv[0], *expand_mount_options(mount_parser, argv[1:])]
    a = parser.parse_args(argv)
    a.argv = argv
    handlers: dict[str, Any] = {"mount": cmd_mount, "umount": cmd_umount, "bucket": cmd_bucket,
                                "status": cmd_status, "fsck": cmd_fsck}
    try:
        code = int(handlers[a.command](a))
        sys.stdout.flush()  # (a reader gone before the last line breaks the pipe here, not at exit)
        return code
    except BaseException as e:
        if not isinstance(single_error(e), BrokenPipeError):
            raise
        # The reader of our output went away (`natsfs bucket ls | head -1`): stop quietly, as a filter
        # killed by SIGPIPE would, and keep the interpreter's last flush from failing again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
