"""Randomized crash consistency of write-back mode: a seeded workload of creates, writes at random offsets,
truncates, renames (also over existing files), unlinks, fsyncs and closes on a write-back mount, with a
model of what each returned call acknowledged; `kill -9` of the daemon at a random point (between calls,
in the middle of one, while uploads run, during the replay of a remount); a remount with the same cache
dir; `natsfs umount` (which waits for the uploads). Then a client that is not natsfs (nats-py's object
store API) must read every acknowledged file byte for byte, nothing unlinked may come back, anything not
acknowledged is the old or the new state of its call (never a mix of versions), lost+found holds only
bytes the workload wrote and not acknowledged, and `natsfs fsck --grace 0` finds the bucket clean.

A few seeds run by default; `NATSFS_CRASHFUZZ_SEEDS=1-200` (or `5,9,12`) runs others. Each failure message
names its seed and the workload it ran; the workload and the kill point follow from the seed, the timing
of the uploads around them does not (a failing seed may need a few runs).

The windows that matter are microseconds wide (between an unlink's tombstone and its journal record,
between a rename's two publishes): a random kill almost never lands there. `NATSFS_CRASHFUZZ_POINT_SEEDS`
(a few by default) runs seeds whose first daemon is started with `NATSFS_TEST_PAUSE_AT` (see
`natsfs.testpoints`): it stops at a named point (the n-th pass), says so in a file, and is killed there."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from helpers import Mount, create_bucket, nats_py_put, with_nats

from natsfs import testpoints
from natsfs.compose import spool_root

DEFAULT_SEEDS = "1,2,3"
# Seeds whose first daemon stopped at each point when chosen (the windows of unlink, rename, delete, put and
# upload; 117: a rename cut between its publishes, which left the replaced target's chunks orphaned).
DEFAULT_POINT_SEEDS = "16,17,28,30,32,69,87,117,168"
NAMES = ["f0", "f1", "f2", "f3", "d/g0", "d/g1"]
# Connection errors of a call in flight when the daemon is killed (its outcome is unknown).
DEAD = {errno.ENOTCONN, errno.ECONNABORTED, errno.EIO}


def _seeds(variable: str = "NATSFS_CRASHFUZZ_SEEDS", default: str = DEFAULT_SEEDS) -> list[int]:
    spec = os.environ.get(variable, default)
    seeds: list[int] = []
    for part in spec.split(","):
        if "-" in part:
            a, b = part.split("-")
            seeds.extend(range(int(a), int(b) + 1))
        elif part.strip():
            seeds.append(int(part))
    return seeds


class Killed(Exception):
    """The daemon is gone: the call in flight failed with a connection error."""


@dataclass
class Model:
    """What the bucket must hold: `acked[name]` (absent: no object); `maybe[name]`: the states a name may
    be in instead, because the call that changed it was in flight at the kill (or a handle held it open
    with writes not synced); `written`: every content the workload produced (lost+found holds only these)."""
    acked: dict[str, bytes] = field(default_factory=dict)
    maybe: dict[str, list[bytes | None]] = field(default_factory=dict)
    written: list[bytes] = field(default_factory=list)
    trace: list[str] = field(default_factory=list)
    shared_nuid_ok: bool = False  # a rename cut between its two publishes leaves both names (documented)

    def allow(self, name: str, *states: bytes | None) -> None:
        options = self.maybe.setdefault(name, [self.acked.get(name)])
        options.extend(states)


def _data(rng: random.Random, size: int) -> bytes:
    # Random bytes of a random seed: distinct contents, cheap to make.
    return random.Random(rng.getrandbits(64)).randbytes(size)


def _size(rng: random.Random) -> int:
    return rng.choice([0, 1, 100, 4096, 65_536, 65_537, 131_072, 200_000, 400_001])


def _call(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except OSError as e:
        if e.errno in DEAD:
            raise Killed(f"{fn.__name__}: {e}") from e
        raise


class Workload:
    def __init__(self, m: Mount, rng: random.Random, model: Model):
        self.m, self.rng, self.model = m, rng, model
        # A handle held open across calls: name, fd, its content now, contents since its last sync.
        self.held: tuple[str, int, bytearray, list[bytes]] | None = None

    def p(self, name: str) -> str:
        return str(self.m.path / name)

    def free_names(self) -> list[str]:
        return [n for n in NAMES if self.held is None or n != self.held[0]]

    def step(self) -> None:
        rng, model = self.rng, self.model
        names = self.free_names()
        existing = [n for n in names if n in model.acked]
        ops = ["create", "create", "pwrite", "truncate", "rename", "unlink", "hold"]
        if self.held is not None:
            ops += ["held_write", "held_write", "held_fsync", "held_close"]
        op = rng.choice(ops)
        if op in ("pwrite", "truncate", "rename", "unlink") and not existing:
            op = "create"
        if op == "hold" and self.held is not None:
            op = "held_write"
        getattr(self, op)(names, existing)

    def _mark(self, text: str) -> None:
        self.model.trace.append(text)

    def create(self, names: list[str], existing: list[str]) -> None:
        name = self.rng.choice(names)
        data = _data(self.rng, _size(self.rng))
        self._mark(f"create {name} {len(data)}")
        self.model.written.append(data)
        old = self.model.acked.get(name)
        try:
            fd = _call(os.open, self.p(name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _call(os.write, fd, data)
            finally:
                try:
                    _call(os.close, fd)
                except Killed:
                    raise
        except Killed:
            self.model.allow(name, b"", data, old)
            raise
        self.model.acked[name] = data

    def pwrite(self, names: list[str], existing: list[str]) -> None:
        name = self.rng.choice(existing)
        old = self.model.acked[name]
        off = self.rng.randint(0, len(old) + 1000)
        patch = _data(self.rng, self.rng.choice([1, 10, 5000, 70_000]))
        new = bytearray(old)
        if len(new) < off:
            new.extend(bytes(off - len(new)))
        new[off:off + len(patch)] = patch
        self._mark(f"pwrite {name} @{off} +{len(patch)} ({len(old)} -> {len(new)})")
        self.model.written.append(bytes(new))
        try:
            fd = _call(os.open, self.p(name), os.O_RDWR)
            try:
                _call(os.pwrite, fd, patch, off)
            finally:
                _call(os.close, fd)
        except Killed:
            self.model.allow(name, bytes(new))
            raise
        self.model.acked[name] = bytes(new)

    def truncate(self, names: list[str], existing: list[str]) -> None:
        name = self.rng.choice(existing)
        old = self.model.acked[name]
        size = self.rng.choice([0, len(old) // 2, len(old) + 3000, 65_536])
        new = old[:size] + bytes(max(0, size - len(old)))
        by_path = self.rng.random() < 0.5
        self._mark(f"truncate {name} {len(old)} -> {size} ({'path' if by_path else 'ftruncate+close'})")
        self.model.written.append(new)
        try:
            if by_path:
                _call(os.truncate, self.p(name), size)
            else:
                fd = _call(os.open, self.p(name), os.O_RDWR)
                try:
                    _call(os.ftruncate, fd, size)
                finally:
                    _call(os.close, fd)
        except Killed:
            self.model.allow(name, new)
            raise
        self.model.acked[name] = new

    def rename(self, names: list[str], existing: list[str]) -> None:
        src = self.rng.choice(existing)
        dst = self.rng.choice([n for n in names if n != src])
        self._mark(f"rename {src} -> {dst}{' (over)' if dst in self.model.acked else ''}")
        data = self.model.acked[src]
        try:
            _call(os.rename, self.p(src), self.p(dst))
        except Killed:
            self.model.allow(src, None)
            self.model.allow(dst, data)
            self.model.shared_nuid_ok = True
            raise
        self.model.acked[dst] = self.model.acked.pop(src)

    def unlink(self, names: list[str], existing: list[str]) -> None:
        name = self.rng.choice(existing)
        self._mark(f"unlink {name}")
        try:
            _call(os.unlink, self.p(name))
        except Killed:
            self.model.allow(name, None)
            raise
        del self.model.acked[name]

    def hold(self, names: list[str], existing: list[str]) -> None:
        name = self.rng.choice(names)
        old = self.model.acked.get(name)
        trunc = old is None or self.rng.random() < 0.3
        self._mark(f"hold {name}{' O_TRUNC' if trunc else ''}")
        flags = os.O_RDWR | os.O_CREAT | (os.O_TRUNC if trunc else 0)
        try:
            fd = _call(os.open, self.p(name), flags, 0o644)
        except Killed:
            self.model.allow(name, b"")
            raise
        content = bytearray() if trunc else bytearray(old or b"")
        self.held = (name, fd, content, [bytes(content)])
        self.model.allow(name, bytes(content))  # (until its next sync, also what the open made)

    def held_write(self, names: list[str], existing: list[str]) -> None:
        assert self.held is not None
        name, fd, content, since = self.held
        off = self.rng.randint(0, len(content) + 100)
        patch = _data(self.rng, self.rng.choice([1, 3000, 70_000, 150_000]))
        if len(content) < off:
            content.extend(bytes(off - len(content)))
        content[off:off + len(patch)] = patch
        self._mark(f"held_write {name} @{off} +{len(patch)} -> {len(content)}")
        self.model.written.append(bytes(content))
        since.append(bytes(content))
        self.model.allow(name, bytes(content))
        _call(os.pwrite, fd, patch, off)

    def held_fsync(self, names: list[str], existing: list[str]) -> None:
        assert self.held is not None
        name, fd, content, since = self.held
        self._mark(f"held_fsync {name} {len(content)}")
        _call(os.fsync, fd)
        self.model.acked[name] = bytes(content)
        self.model.maybe[name] = [bytes(content)]
        since[:] = [bytes(content)]

    def held_close(self, names: list[str], existing: list[str]) -> None:
        assert self.held is not None
        name, fd, content, _ = self.held
        self._mark(f"held_close {name} {len(content)}")
        self.held = None
        _call(os.close, fd)
        self.model.acked[name] = bytes(content)
        self.model.maybe.pop(name, None)

    def drop_held(self, closing: bool = False) -> None:
        """After the kill: the held handle's unsynced writes are not acknowledged (`maybe` has them).
        `closing`: before an unmount, a close (acknowledged)."""
        if self.held is not None:
            if closing:
                self.held_close([], [])
                return
            with contextlib.suppress(OSError):
                os.close(self.held[1])
            self.held = None


def _kill(m: Mount) -> None:
    assert m.proc is not None
    m.proc.kill()
    m.proc.wait()
    if m.proc.stdout:
        m.proc.stdout.close()
    m.proc = None
    subprocess.run(["fusermount3", "-u", "-z", str(m.path)], capture_output=True)


def _remount(m: Mount) -> None:
    m.args = [a for a in m.args if not a.startswith("--write-back")] + ["--write-back"]
    m.start()


def _bucket_contents(url: str, bucket: str) -> dict[str, bytes]:
    """Every live object of the bucket with its bytes, as nats-py reads them."""
    from nats.js.errors import NotFoundError

    async def fn(nc: Any, js: Any) -> dict[str, bytes]:
        obs = await js.object_store(bucket)
        try:
            infos = await asyncio.wait_for(obs.list(ignore_deletes=True), 30)
        except NotFoundError:
            infos = []
        out = {}
        for info in infos:
            if info.name.endswith("/"):
                continue  # a directory marker
            out[info.name] = (await asyncio.wait_for(obs.get(info.name), 60)).data
        return out

    return with_nats(url, fn)


def _fsck(url: str, bucket: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "natsfs", "fsck", bucket, "--server", url, "--grace", "0"],
                          capture_output=True, text=True, timeout=120)


def _describe(v: bytes | None) -> str:
    return "absent" if v is None else f"{len(v)} bytes {v[:8].hex()}"


def _mount_paused_at(point: str, marker: Any, mounter: Any, *args: str) -> Mount:
    """The first daemon, started to stop at `point` (`natsfs.testpoints`); later ones are not."""
    os.environ["NATSFS_TEST_PAUSE_AT"] = point
    os.environ["NATSFS_TEST_PAUSE_FILE"] = str(marker)
    try:
        return mounter(*args)
    finally:
        del os.environ["NATSFS_TEST_PAUSE_AT"], os.environ["NATSFS_TEST_PAUSE_FILE"]


def _kill_when_paused(proc: Any, marker: Any, stop: threading.Event) -> threading.Thread:
    def watch() -> None:
        while not stop.wait(0.005):
            if marker.exists():
                proc.kill()
                return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def run_seed(seed: int, url: str, bucket: str, mounter: Any, *, paused: Any = None) -> None:
    """`paused`: a file path; the seed then picks a named point (`natsfs.testpoints`) where the first
    daemon stops, and the kill lands there (or after the workload, if it never got there)."""
    rng = random.Random(seed if paused is None else 1_000_000 + seed)
    model = Model()
    create_bucket(url, bucket)
    for name in rng.sample(NAMES, rng.randint(0, 3)):  # objects another client stored before the mount
        data = _data(rng, _size(rng))
        nats_py_put(url, bucket, name, data, create=False)
        model.acked[name] = data
    delay = rng.choice(["--write-back", "--write-back", "--write-back=0.2", "--write-back=1h"])
    point = ""
    if paused is not None:
        point = f"{rng.choice(testpoints.POINTS)}:{rng.choice([0, 0, 1, 2, 5])}"
        m = _mount_paused_at(point, paused, mounter, url, "--bucket", bucket, delay)
        mode = "point"
    else:
        m = mounter(url, "--bucket", bucket, delay)
        mode = rng.choice(["between", "between", "during", "umount"])
    os.makedirs(m.path / "d", exist_ok=True)
    # "during": calls until the kill cuts one (at a random moment); else the kill comes after the last
    # call, a random pause later (uploads under way), or in the middle of `natsfs umount`'s wait.
    n_ops = 1000 if mode == "during" else rng.randint(10, 80) if mode == "point" else rng.randint(1, 40)
    kill_in = rng.uniform(0.02, 1.5) if mode == "during" else rng.choice([0.0, rng.uniform(0.0, 0.4)])
    model.trace.append(f"seed {seed}: {delay}, kill {mode} {point or f'{kill_in:.3f} s'}; before: "
                       + ", ".join(f"{n}={len(d)}" for n, d in model.acked.items()))
    work = Workload(m, rng, model)
    timer: threading.Timer | None = None
    umounting: subprocess.Popen[bytes] | None = None
    proc = m.proc
    stop_watch = threading.Event()
    if mode == "during":
        assert proc is not None
        timer = threading.Timer(kill_in, proc.kill)
        timer.start()
    elif mode == "point":
        _kill_when_paused(proc, paused, stop_watch)
    try:
        for _ in range(n_ops):
            work.step()
        if mode == "umount":
            work.drop_held(closing=True)
            umounting = subprocess.Popen([sys.executable, "-m", "natsfs", "umount", str(m.path)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(kill_in)
        else:
            time.sleep(kill_in)
    except Killed as e:
        model.trace.append(f"  (killed in flight: {e})")
    finally:
        if timer is not None:
            timer.cancel()
        stop_watch.set()
    if mode == "point":
        model.trace.append(f"  (paused at {point})" if paused.exists() else f"  ({point} never reached)")
    model.trace.append("kill -9")
    if m.proc is not None and m.proc.poll() is not None and mode == "umount":
        model.trace.append("  (umount was done before the kill)")
        m.proc = None
        subprocess.run(["fusermount3", "-u", "-z", str(m.path)], capture_output=True)
    else:
        _kill(m)
    if umounting is not None:
        umounting.wait(60)
    work.drop_held()
    # Sometimes the replay is killed too (once or twice), at a random moment.
    for _ in range(rng.choice([0, 0, 1, 2])):
        _remount(m)
        pause = rng.uniform(0.0, 0.6)
        model.trace.append(f"remount, kill -9 after {pause:.3f} s")
        time.sleep(pause)
        _kill(m)
    _remount(m)
    r = subprocess.run([sys.executable, "-m", "natsfs", "umount", str(m.path)], capture_output=True, text=True,
                       timeout=180)
    if m.proc is not None:
        m.proc.wait(60)
    trace = "\n".join(model.trace)
    assert r.returncode == 0, f"{trace}\numount: {r.stderr}"

    got = _bucket_contents(url, bucket)
    problems = []
    for name in sorted(set(NAMES) | set(got)):
        have = got.get(name)
        allowed = model.maybe.get(name, [model.acked.get(name)])
        if have not in allowed:
            problems.append(f"{name}: bucket has {_describe(have)}, acknowledged "
                            f"{_describe(model.acked.get(name))}; allowed {[_describe(a) for a in allowed]}")
    root = spool_root(m.cache_dir, m.path.resolve()) / "lost+found"
    kept = sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []
    for p in kept:
        rel = p.relative_to(root)
        content = p.read_bytes()
        if rel.parts[0] != "leftover":
            # No other client writes: a conflict is explained only by a call the kill cut (an unlink of a
            # pending rewrite, or a rename over one, cut after its change reached the bucket is recognised
            # by the replay and keeps nothing here: WriteBack.settle_moves).
            if not any(content == state for states in model.maybe.values() for state in states):
                problems.append(f"lost+found/{rel}: a conflict or refusal, but no other client wrote "
                                f"({len(content)} bytes)")
        elif content not in model.written and not any(w.startswith(content) or content.startswith(w)
                                                      for w in model.written):
            problems.append(f"lost+found/{rel}: {len(content)} bytes the workload never wrote")
    f = _fsck(url, bucket)
    if f.returncode != 0:
        lines = [line for line in f.stdout.splitlines() if line.strip()]
        shared_only = all("sharing one nuid" in line or "names sharing" in line for line in lines[:-1])
        if not (model.shared_nuid_ok and shared_only):
            problems.append(f"fsck: {f.stdout.strip()} {f.stderr.strip()}")
    unexpected = m.unexpected_log()
    if unexpected:
        problems.append("daemon log: " + "\n".join(unexpected[:5]))
    if os.environ.get("NATSFS_CRASHFUZZ_VERBOSE"):
        print(f"\n{trace}\n  bucket: " + ", ".join(f"{n}={len(d)}" for n, d in sorted(got.items()))
              + f"; lost+found: {[str(p.relative_to(root)) for p in kept]}")
    assert not problems, f"{trace}\n--- problems:\n" + "\n".join(problems)
    m.expect_log(".")  # (checked above, with the trace)


@pytest.mark.parametrize("seed", _seeds())
def test_write_back_survives_kill_9_at_random_points(seed, nats_url, bucket_name, mounter):
    run_seed(seed, nats_url, bucket_name, mounter)


@pytest.mark.parametrize("seed", _seeds("NATSFS_CRASHFUZZ_POINT_SEEDS", DEFAULT_POINT_SEEDS))
def test_write_back_survives_kill_9_at_named_points(seed, nats_url, bucket_name, mounter, tmp_path):
    run_seed(seed, nats_url, bucket_name, mounter, paused=tmp_path / "paused")
