"""The model test's twin over the in-memory stack: many examples in seconds, no kernel, no server.

A Hypothesis `RuleBasedStateMachine` applies the same operations to a bucket served by the filesystem
core (built by `natsfs.compose` over `MemoryStreams`, its background tasks running, driven through the
FUSE adapter's methods as the kernel would call them) and to a local temp directory (the reference),
and checks that every operation ends the same way (the same value or the same errno) and that after
every step both trees hold the same names, types and sizes, and after every close the same bytes.
Another client (the nats.go-exact writers of tests/gowriters.py) puts and deletes objects under `ext/`.

Operations the kernel answers itself before asking a filesystem (a write open of a directory, a rename
of a directory into itself) are not generated. The FUSE run (test_model.py) stays the real-kernel check.
CI runs `NATSFS_MEMORY_EXAMPLES` (default 1000) derandomized examples.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pyfuse3
import pytest
import trio
import trio.testing
from gowriters import delete_object, put_object
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from natsfs.compose import Built, build_filesystem
from natsfs.config import Config
from natsfs.memstreams import MemoryStreams

EXAMPLES = int(os.environ.get("NATSFS_MEMORY_EXAMPLES", "3000"))
STEPS = int(os.environ.get("NATSFS_MEMORY_STEPS", "12"))
BUCKET = "b"
ROOT = pyfuse3.ROOT_INODE
NAMES = ["a", "b", "d"]
PATHS = [*NAMES, *(f"{p}/{n}" for p in NAMES for n in NAMES)]
payloads = st.binary(max_size=3000)


class Ctx:
    """What pyfuse3 hands a request about its caller."""

    uid = gid = 1000
    pid = 1
    umask = 0o022


CTX = Ctx()


class Listing:
    """A readdir token: `fake_readdir_reply` collects the entries (pyfuse3's reply needs the kernel)."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, pyfuse3.EntryAttributes]] = []


def fake_readdir_reply(token: Listing, name: bytes, attr: pyfuse3.EntryAttributes, next_id: int) -> bool:
    token.entries.append((os.fsdecode(name), attr))
    return True


class Env:
    """The stack one example drives: the FUSE adapter's methods, the streams other clients write to."""

    def __init__(self, streams: MemoryStreams, built: Built):
        self.streams = streams
        self.ops = built.ops

    async def settle(self) -> None:
        await trio.testing.wait_all_tasks_blocked()

    async def cat(self, path: str) -> bytes:
        fi = await self.ops.open(await _ino(self, path), os.O_RDONLY, CTX)
        out, off = [], 0
        try:
            while piece := await self.ops.read(fi.fh, off, 64 * 1024):
                out.append(piece)
                off += len(piece)
        finally:
            await self.ops.release(fi.fh)
        return b"".join(out)


class Stack:
    """The core over MemoryStreams in a trio run on its own thread; `call` runs one coroutine there."""

    def __init__(self, cache_dir: Path):
        self._cache_dir = cache_dir
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self.env: Env | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the in-memory stack did not start")
        if self._failed is not None:
            raise self._failed

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as e:  # reported to the test thread
            self._failed = e
            self._ready.set()

    async def _main(self) -> None:
        streams = MemoryStreams()
        config = Config(mountpoint=Path("/nonexistent"), bucket=BUCKET, uid=1000, gid=1000, chunk_size=1024,
                        cache_dir=self._cache_dir, cache_size=16 << 20, upload_worker=False)
        built = build_filesystem(config, streams)
        await built.store.create_bucket(BUCKET)
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            await built.start(nursery)
            self.env = Env(streams, built)
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def close(self) -> None:
        trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(30)


def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return ("ok", fn())
    except OSError as e:
        return ("err", errno.errorcode.get(e.errno or 0, str(e.errno)))


def core_outcome(stack: Stack, fn: Callable[[Env], Awaitable[Any]]) -> tuple[str, Any]:
    assert stack.env is not None
    env = stack.env
    try:
        return ("ok", stack.call(fn, env))
    except pyfuse3.FUSEError as e:
        return ("err", errno.errorcode.get(e.errno, str(e.errno)))


async def _ino(env: Env, path: str, *, directory: bool = False) -> int:
    """Walk `path` as the kernel does: a name under something that is not a directory is ENOTDIR (the
    kernel answers that itself, without asking the filesystem); with `directory`, `path` must be one
    (the parent of a name an operation is about)."""
    ino, is_dir = ROOT, True
    for seg in [s for s in path.split("/") if s]:
        if not is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        attr = await env.ops.lookup(ino, os.fsencode(seg), CTX)
        ino, is_dir = attr.st_ino, stat.S_ISDIR(attr.st_mode)
    if directory and not is_dir:
        raise pyfuse3.FUSEError(errno.ENOTDIR)
    return ino


def _split(path: str) -> tuple[str, bytes]:
    parent, _, name = path.rpartition("/")
    return parent, os.fsencode(name)


async def _tree(env: Env) -> dict[str, tuple[Any, ...]]:
    out: dict[str, tuple[Any, ...]] = {}

    async def walk(ino: int, prefix: str) -> None:
        fh = await env.ops.opendir(ino, CTX)
        listing = Listing()
        try:
            await env.ops.readdir(fh, 0, listing)
        finally:
            await env.ops.releasedir(fh)
        for name, attr in listing.entries:
            rel = prefix + name
            if stat.S_ISDIR(attr.st_mode):
                out[rel] = ("dir",)
                await walk(attr.st_ino, rel + "/")
            else:
                out[rel] = ("file", attr.st_size)

    await walk(ROOT, "")
    return out


def _local_tree(root: Path) -> dict[str, tuple[Any, ...]]:
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        prefix = "" if rel == "." else rel + "/"
        for d in dirnames:
            out[prefix + d] = ("dir",)
        for f in filenames:
            out[prefix + f] = ("file", os.path.getsize(os.path.join(dirpath, f)))
    return out


class CoreVersusLocalDisk(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.scratch = Path(tempfile.mkdtemp(prefix="natsfs-memory-model-"))
        self.local = self.scratch / "reference"
        self.local.mkdir()
        self.stack = Stack(self.scratch / "cache")

    def teardown(self) -> None:
        try:
            self._same_bytes()
        finally:
            self.stack.close()
            shutil.rmtree(self.scratch, ignore_errors=True)

    def _both(self, what: str, local: Callable[[Path], Any], core: Callable[[Env], Awaitable[Any]]) -> None:
        expected = outcome(lambda: local(self.local))
        actual = core_outcome(self.stack, core)
        assert actual == expected, f"{what}: local disk {expected}, natsfs {actual}"

    def _is_dir(self, path: str) -> bool:
        return (self.local / path).is_dir()

    def _same_bytes(self) -> None:
        for rel, entry in _local_tree(self.local).items():
            if entry[0] == "file":
                self._both(f"read {rel}", lambda root, r=rel: (root / r).read_bytes(),
                           lambda env, r=rel: env.cat(r))

    @invariant()
    def same_names_types_and_sizes(self) -> None:
        assert self.stack.call(_tree, self.stack.env) == _local_tree(self.local)

    @rule(path=st.sampled_from(PATHS), data=payloads)
    def write_whole_file(self, path: str, data: bytes) -> None:
        if self._is_dir(path):
            return  # a write open of a directory is refused by the kernel (EISDIR)

        def local(root: Path) -> int:
            return (root / path).write_bytes(data)

        async def core(env: Env) -> int:
            parent, name = _split(path)
            pino = await _ino(env, parent, directory=True)
            try:
                ino = (await env.ops.lookup(pino, name, CTX)).st_ino
            except pyfuse3.FUSEError as e:
                if e.errno != errno.ENOENT:
                    raise
                fi, _ = await env.ops.create(pino, name, 0o644, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, CTX)
            else:
                fi = await env.ops.open(ino, os.O_WRONLY | os.O_TRUNC, CTX)
            try:
                written = await env.ops.write(fi.fh, 0, data) if data else 0
                await env.ops.flush(fi.fh)
            finally:
                await env.ops.release(fi.fh)
            return written

        self._both(f"write {path} ({len(data)} bytes)", local, core)

    @rule(path=st.sampled_from(PATHS), offset=st.integers(0, 4000), data=st.binary(min_size=1, max_size=2000))
    def pwrite_existing_file(self, path: str, offset: int, data: bytes) -> None:
        if not (self.local / path).is_file():
            return

        def local(root: Path) -> int:
            fd = os.open(root / path, os.O_WRONLY)
            try:
                return os.pwrite(fd, data, offset)
            finally:
                os.close(fd)

        async def core(env: Env) -> int:
            fi = await env.ops.open(await _ino(env, path), os.O_WRONLY, CTX)
            try:
                written = await env.ops.write(fi.fh, offset, data)
                await env.ops.flush(fi.fh)
            finally:
                await env.ops.release(fi.fh)
            return written

        self._both(f"pwrite {path} at {offset}", local, core)

    @rule(path=st.sampled_from(PATHS))
    def read_file(self, path: str) -> None:
        if self._is_dir(path):
            return
        self._both(f"read {path}", lambda root: (root / path).read_bytes(), lambda env: env.cat(path))

    @rule(path=st.sampled_from(PATHS))
    def unlink(self, path: str) -> None:
        async def core(env: Env) -> None:
            parent, name = _split(path)
            await env.ops.unlink(await _ino(env, parent, directory=True), name, CTX)

        self._both(f"unlink {path}", lambda root: os.unlink(root / path), core)

    @rule(path=st.sampled_from(PATHS))
    def mkdir(self, path: str) -> None:
        async def core(env: Env) -> None:
            parent, name = _split(path)
            await env.ops.mkdir(await _ino(env, parent, directory=True), name, 0o755, CTX)

        self._both(f"mkdir {path}", lambda root: os.mkdir(root / path), core)

    @rule(path=st.sampled_from(PATHS))
    def rmdir(self, path: str) -> None:
        async def core(env: Env) -> None:
            parent, name = _split(path)
            await env.ops.rmdir(await _ino(env, parent, directory=True), name, CTX)

        self._both(f"rmdir {path}", lambda root: os.rmdir(root / path), core)

    @rule(src=st.sampled_from(PATHS), dst=st.sampled_from(PATHS))
    def rename(self, src: str, dst: str) -> None:
        if src == dst or dst.startswith(src + "/") or src.startswith(dst + "/"):
            return  # answered by the kernel (a directory into itself, over its own parent)

        async def core(env: Env) -> None:
            sp, sn = _split(src)
            dp, dn = _split(dst)
            old_parent = await _ino(env, sp, directory=True)
            await env.ops.rename(old_parent, sn, await _ino(env, dp, directory=True), dn, 0, CTX)

        self._both(f"rename {src} -> {dst}", lambda root: os.rename(root / src, root / dst), core)

    @rule(name=st.sampled_from(NAMES), data=payloads)
    def other_client_puts(self, name: str, data: bytes) -> None:
        assert self.stack.env is not None
        self.stack.call(put_object, self.stack.env.streams, BUCKET, f"ext/{name}", data)
        self.stack.call(self.stack.env.settle)
        (self.local / "ext").mkdir(exist_ok=True)
        (self.local / "ext" / name).write_bytes(data)
        self._same_bytes()

    @rule(name=st.sampled_from(NAMES))
    def other_client_deletes(self, name: str) -> None:
        if not (self.local / "ext" / name).is_file():
            return
        assert self.stack.env is not None
        self.stack.call(delete_object, self.stack.env.streams, BUCKET, f"ext/{name}")
        self.stack.call(self.stack.env.settle)
        (self.local / "ext" / name).unlink()
        if not any((self.local / "ext").iterdir()):
            (self.local / "ext").rmdir()  # a directory that only held objects goes with them


@pytest.mark.timeout(600)
def test_random_operations_on_the_core_match_a_local_directory(monkeypatch):
    monkeypatch.setattr(pyfuse3, "readdir_reply", fake_readdir_reply)
    CoreVersusLocalDisk.TestCase.settings = settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    CoreVersusLocalDisk.TestCase().runTest()
