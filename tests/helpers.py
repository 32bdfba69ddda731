"""Test helpers: a mount in a child process, and other NATS clients (nats-py, our ADR-20 layer)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import trio

T = TypeVar("T")

# The start of a daemon log record (natsfs.cli's format: "<date> <time>,<ms> <LEVEL> <logger>: <message>").
_RECORD_START = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?P<level>[A-Z]+) ", re.MULTILINE)
_BAD_LEVELS = ("ERROR", "CRITICAL")

# A copy of ../shared/fixtures/adr20, so a clean checkout tests on its own.
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "adr20"


class Mount:
    """`natsfs mount --foreground` in a child process, ready when the mountpoint is a mount."""

    def __init__(self, url: str, mountpoint: Path, args: list[str], *, log_file: Path, cache_dir: Path):
        self.url = url
        self.path = Path(mountpoint)
        self.args = args
        self.log_file = log_file
        self.cache_dir = cache_dir
        self.proc: subprocess.Popen[bytes] | None = None
        # Patterns (re.search over a whole record) of ERROR records and tracebacks this test provokes.
        self.expected: list[re.Pattern[str]] = []

    def expect_log(self, pattern: str) -> None:
        """Declare an ERROR record or traceback the test provokes on purpose (any other one fails it)."""
        self.expected.append(re.compile(pattern))

    def unexpected_log(self) -> list[str]:
        """The daemon's ERROR/CRITICAL records and records with a traceback that no `expect_log` covers."""
        return unexpected_records(self.log(), self.expected)

    def command(self) -> list[str]:
        """The daemon's command line (a test may run it through a launcher of its own)."""
        return [sys.executable, "-m", "natsfs", "mount", str(self.path), "--foreground",
                "--log-level", "debug", "--log-file", str(self.log_file), "--cache-dir", str(self.cache_dir),
                *(["--server", self.url] if self.url else []), *self.args]

    def start(self, timeout: float = 30.0) -> None:
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.ismount(self.path):
                return
            if self.proc.poll() is not None:
                out = self.proc.stdout.read().decode(errors="replace") if self.proc.stdout else ""
                raise RuntimeError(f"mount exited with {self.proc.returncode}: {out}\n{self.log()}")
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"mount did not come up in {timeout}s\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")
        except OSError:
            return ""

    def mounted(self) -> bool:
        """In /proc/mounts (os.path.ismount is False for a mount whose daemon died: ENOTCONN)."""
        with open("/proc/mounts") as f:
            return any(line.split()[1] == str(self.path) for line in f)

    def stop(self) -> None:
        if self.mounted():
            r = subprocess.run(["fusermount3", "-u", str(self.path)], capture_output=True)
            if r.returncode != 0:
                subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)
        if self.proc is not None:
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            if self.proc.stdout:
                self.proc.stdout.close()
            self.proc = None

    def remount(self) -> None:
        self.stop()
        self.start()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and os.path.ismount(self.path)

    def __truediv__(self, other: str) -> Path:
        return self.path / other


def unexpected_records(text: str, expected: list[re.Pattern[str]]) -> list[str]:
    """The records of a daemon log at ERROR or above, or with a traceback, that match none of `expected`."""
    starts = [m.start() for m in _RECORD_START.finditer(text)]
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
    records = [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]
    out = []
    for record in records:
        head = _RECORD_START.match(record)
        bad = (head is not None and head["level"] in _BAD_LEVELS) or "Traceback (most recent call last)" in record
        if bad and not any(p.search(record) for p in expected):
            out.append(record.rstrip())
    return out


def check_daemon_logs(mounts: list[Mount], expected: list[str]) -> None:
    """Fail the test when a daemon logged an ERROR or a traceback it did not declare (S3QL's rule: a test
    that provokes an errno must not pass on a crash that was turned into EIO)."""
    found = []
    for m in mounts:
        for record in unexpected_records(m.log(), [*m.expected, *map(re.compile, expected)]):
            found.append(f"{m.log_file}:\n{record}")
    if found:
        import pytest

        pytest.fail("unexpected ERROR/traceback in the daemon log (declare it with mount.expect_log or "
                    "@pytest.mark.expect_log):\n" + "\n".join(found[:20]), pytrace=False)


# ---------------------------------------------------------------- other clients
def with_nats(url: str, fn: Callable[[Any, Any], Awaitable[T]]) -> T:
    """Run `fn(nc, js)` with a nats-py connection (the 'other client')."""
    import nats

    async def main() -> T:
        nc = await nats.connect(url)
        try:
            return await fn(nc, nc.jetstream())
        finally:
            await nc.close()

    return asyncio.run(main())


def with_store(url: str, fn: Callable[[Any], Awaitable[T]]) -> T:
    """Run `fn(store)` with our own ADR-20 layer (natsfs.adr20.ObjectStore) under trio."""
    from natsfs.adr20 import ObjectStore
    from natsfs.bridge import Bridge
    from natsfs.jetstream import JetStreams

    async def main() -> T:
        bridge = Bridge([url])
        await bridge.connect()
        try:
            return await fn(ObjectStore(JetStreams(bridge)))
        finally:
            await bridge.close()

    return trio.run(main)


def create_bucket(url: str, bucket: str, **kwargs: Any) -> None:
    with_store(url, lambda s: s.create_bucket(bucket, **kwargs))


def nats_py_put(url: str, bucket: str, name: str, data: bytes, *, create: bool = True) -> None:
    async def fn(nc: Any, js: Any) -> None:
        if create:
            try:
                obs = await js.object_store(bucket)
            except Exception:
                obs = await js.create_object_store(bucket)
        else:
            obs = await js.object_store(bucket)
        await obs.put(name, data)

    with_nats(url, fn)


def nats_py_get(url: str, bucket: str, name: str) -> bytes:
    async def fn(nc: Any, js: Any) -> bytes:
        obs = await js.object_store(bucket)
        res = await asyncio.wait_for(obs.get(name), 60)
        return res.data

    return with_nats(url, fn)


def stored_layout(url: str, bucket: str, name: str) -> dict[str, Any]:
    """What the stream holds for `name`, read message by message (no consumer): the meta's chunk count,
    size and digest, the sequences of the messages on its chunk subject and whether their bytes, in
    order, match the digest. Used to tell a stored object that is wrong from a client that read it wrong."""
    import base64
    import hashlib
    import json

    async def fn(nc: Any, js: Any) -> dict[str, Any]:
        stream = f"OBJ_{bucket}"
        key = base64.urlsafe_b64encode(name.encode()).decode()
        meta = json.loads((await js.get_msg(stream, subject=f"$O.{bucket}.M.{key}")).data)
        subject = f"$O.{bucket}.C.{meta['nuid']}"
        seqs: list[int] = []
        hasher = hashlib.sha256()
        size = 0
        seq = 1
        while True:
            try:
                msg = await js.get_msg(stream, seq=seq, subject=subject, next=True)
            except Exception:
                break
            seqs.append(msg.seq)
            hasher.update(msg.data or b"")
            size += len(msg.data or b"")
            seq = msg.seq + 1
        digest = "SHA-256=" + base64.urlsafe_b64encode(hasher.digest()).decode()
        return {"chunks": meta.get("chunks"), "size": meta.get("size"), "digest": meta.get("digest"),
                "stored_chunks": len(seqs), "stored_size": size, "stored_digest_ok": digest == meta.get("digest"),
                "seqs": seqs}

    return with_nats(url, fn)


def raw_put(url: str, bucket: str, name: str, chunks: list[bytes], *, nuid: str | None = None,
            meta_extra: dict[str, Any] | None = None) -> None:
    """Publish an object by hand with exactly these chunks (uneven sizes allowed), as nats.go would."""
    import secrets

    from natsfs.adr20 import digest_of, meta_doc, meta_json

    nuid = nuid or secrets.token_hex(11)
    data = b"".join(chunks)
    doc = meta_doc(name=name, bucket=bucket, nuid=nuid, size=len(data), chunks=len(chunks), digest=digest_of(data))
    meta = meta_json(doc | (meta_extra or {}))
    enc = base64.urlsafe_b64encode(name.encode()).decode()

    async def fn(nc: Any, js: Any) -> None:
        for c in chunks:
            await js.publish(f"$O.{bucket}.C.{nuid}", c)
        await js.publish(f"$O.{bucket}.M.{enc}", meta, headers={"Nats-Rollup": "sub"})

    with_nats(url, fn)


def replay_fixtures(url: str, *names: str) -> None:
    sys.path.insert(0, str(FIXTURES))
    from replay import replay  # type: ignore[import-not-found]

    async def fn(nc: Any, js: Any) -> None:
        for n in names:
            await replay(js, str(FIXTURES / n))

    with_nats(url, fn)


def wait_for(pred: Callable[[], bool], timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def full_local_disk(monkeypatch: Any) -> Callable[[], None]:
    """Make lost+found unwritable as on a full local disk (ENOSPC), until the returned function frees it:
    a copy of bytes held in memory gets its first page written and then fails (what a full tmpfs does),
    and a new lost+found directory cannot be made (a full ext4), so a spool file cannot be moved there."""
    import errno as errno_

    from natsfs import compose, staging

    real_restore, real_private_dir = staging.restore_file, staging.private_dir

    def no_space() -> OSError:
        return OSError(errno_.ENOSPC, os.strerror(errno_.ENOSPC))

    def restore_file(path: Path, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data[:4096])
        finally:
            os.close(fd)
        raise no_space()

    def private_dir(path: Path) -> Path:
        if not path.is_dir():
            raise no_space()
        return real_private_dir(path)

    monkeypatch.setattr(staging, "restore_file", restore_file)
    monkeypatch.setattr(compose, "restore_file", restore_file)
    monkeypatch.setattr(staging, "private_dir", private_dir)

    def free() -> None:
        monkeypatch.setattr(staging, "restore_file", real_restore)
        monkeypatch.setattr(compose, "restore_file", real_restore)
        monkeypatch.setattr(staging, "private_dir", real_private_dir)

    return free


def saved_version(n: int) -> bytes:
    """Version `n` of an atomically saved file: its tag repeated, one of five sizes (96-416 KiB)."""
    return f"{n}:".encode().ljust(32, b".") * (3000 + 3000 * (n % 5))


def whole_version(data: bytes) -> bool:
    """Whether `data` is exactly one `saved_version`: its tag throughout, and that version's size."""
    tag = data[:32].split(b":")[0]
    return tag.isdigit() and data == saved_version(int(tag))


def race_atomic_saves(save_dir: Path, read_dir: Path, saves: int, allowed: tuple[int, ...] = ()
                      ) -> tuple[dict[str, int], list[str]]:
    """`saves` atomic saves (write `.tmp`, rename it over `f`, as editors do) in `save_dir` while a thread
    reads `f` in `read_dir` again and again. Returns the outcomes (`whole` reads, and errnos in `allowed`
    by name) and the bad reads: failures not allowed, and data that is not one whole `saved_version`."""
    saves_done = threading.Event()
    bad: list[str] = []
    outcomes = {"whole": 0, **{errno.errorcode[e]: 0 for e in allowed}}

    def read_until_saved() -> None:
        while not saves_done.is_set():
            try:
                data = (read_dir / "f").read_bytes()
            except OSError as e:
                if e.errno in allowed:
                    outcomes[errno.errorcode[e.errno]] += 1
                else:
                    bad.append(f"open/read failed: {e!r}")
                continue
            if whole_version(data):
                outcomes["whole"] += 1
            else:
                bad.append(f"not one whole version: {len(data)} bytes, tag {data[:8]!r}, "
                           f"{len(data) - len(data.rstrip(bytes(1)))} zero bytes at the end")

    reader = threading.Thread(target=read_until_saved)
    reader.start()
    try:
        for n in range(1, saves + 1):
            (save_dir / ".tmp").write_bytes(saved_version(n))
            os.rename(save_dir / ".tmp", save_dir / "f")
    finally:
        saves_done.set()
        reader.join()
    return outcomes, bad


def daemon_children(pid: int) -> dict[str, int]:
    """The daemon's live child processes by role (upload worker, kernel notifier); zombies left out."""
    found = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
            for child in f.read().split():
                with contextlib.suppress(OSError), open(f"/proc/{child}/cmdline", "rb") as g:
                    cmdline = g.read()
                    role = "worker" if b"upload-worker" in cmdline else \
                        "notifier" if b"natsfs.notifier" in cmdline else ""
                    if role:
                        found[role] = int(child)
    return found


def stop_process(pid: int) -> None:
    """SIGSTOP `pid` and wait until every thread of it has stopped (until the thread the kernel picked
    runs and starts the group stop, the others go on serving)."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        return all(state in "tT" for state in states)

    assert wait_for(stopped, timeout=10, interval=0.005)
