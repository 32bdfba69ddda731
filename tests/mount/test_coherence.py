"""Live coherence through a real mount: other clients change the bucket while the mount is up.

Other clients are nats-py (its ObjectStore), raw publishes, and the nats.go-style fixture writers of
`natsfs.memstreams` over our own JetStream layer. Outcomes are asserted loosely: every change must show
up eventually (generous timeouts), never how fast; the bench measures the latency.
"""

from __future__ import annotations

import errno
import mmap
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from gowriters import delete_object, put_link, put_object, rename_object
from helpers import (
    Mount,
    check_daemon_logs,
    create_bucket,
    daemon_children,
    nats_py_get,
    nats_py_put,
    race_atomic_saves,
    raw_put,
    saved_version,
    wait_for,
    with_nats,
    with_store,
)

from natsfs.adr20 import meta_subject, stream_name

T = 30.0  # seconds any change may take to show on a loaded machine (the target is well under 1 s)


def read_or_none(p) -> bytes | None:
    try:
        return p.read_bytes()
    except OSError:
        return None


def exists(p) -> bool:
    try:
        os.stat(p)
        return True
    except FileNotFoundError:
        return False


def fixture_call(url: str, fn, *args):
    """Run one of natsfs.memstreams's nats.go-style writers against the real server."""
    return with_store(url, lambda store: fn(store.streams, *args))


def test_puts_overwrites_deletes_and_links_by_other_clients_show_up(nats_url, bucket_name, mounter):
    nats_py_put(nats_url, bucket_name, "dir/a.txt", b"first version\n")
    m = mounter(nats_url)
    b = m.path / bucket_name
    a = b / "dir" / "a.txt"
    # Read it: the kernel now caches its entry, attributes (60 s) and pages.
    assert a.read_bytes() == b"first version\n"
    assert a.stat().st_size == 14

    # A new object appears (in listings and by name).
    nats_py_put(nats_url, bucket_name, "dir/new.txt", b"new")
    assert wait_for(lambda: "new.txt" in os.listdir(b / "dir"), T)
    assert (b / "dir" / "new.txt").read_bytes() == b"new"

    # An overwrite: never the old bytes once it is visible, despite the kernel's long timeouts.
    nats_py_put(nats_url, bucket_name, "dir/a.txt", b"second, longer version\n")
    assert wait_for(lambda: read_or_none(a) == b"second, longer version\n", T)
    assert a.stat().st_size == 23

    # A delete (nats.go style: tombstone, then the chunks are purged): gone from ls, stat is ENOENT.
    fixture_call(nats_url, delete_object, bucket_name, "dir/a.txt")
    assert wait_for(lambda: not exists(a), T)
    with pytest.raises(FileNotFoundError):
        os.stat(a)
    assert os.listdir(b / "dir") == ["new.txt"]

    # A new directory and a link, from raw publishes.
    raw_put(nats_url, bucket_name, "deep/er/raw.bin", [b"r" * 1000, b"s" * 10])
    fixture_call(nats_url, put_link, bucket_name, "deep/link", bucket_name, "dir/new.txt")
    assert wait_for(lambda: exists(b / "deep" / "link"), T)
    assert (b / "deep" / "link").is_symlink() and (b / "deep" / "link").read_bytes() == b"new"
    assert (b / "deep" / "er" / "raw.bin").read_bytes() == b"r" * 1000 + b"s" * 10

    # The last object of a directory goes: the directory goes too.
    fixture_call(nats_url, delete_object, bucket_name, "deep/er/raw.bin")
    assert wait_for(lambda: not exists(b / "deep" / "er"), T)
    assert os.listdir(b / "deep") == ["link"]
    assert m.alive


def test_unchanged_objects_keep_their_page_cache(nats_url, bucket_name, mounter):
    nats_py_put(nats_url, bucket_name, "stays.bin", random.Random(1).randbytes(1 << 20))
    m = mounter(nats_url)
    p = m.path / bucket_name / "stays.bin"
    data = p.read_bytes()
    import json

    def reads() -> int:
        return json.loads(os.getxattr(m.path, "user.natsfs.stats"))["cache"]["reads"]

    before = reads()
    for i in range(20):  # changes to other objects of the bucket
        nats_py_put(nats_url, bucket_name, f"other-{i}", b"x")
    assert wait_for(lambda: exists(m.path / bucket_name / "other-19"), T)
    assert p.read_bytes() == data
    assert reads() == before  # served by the kernel's page cache, not by the daemon


def test_rename_by_another_client_moves_the_entry(nats_url, bucket_name, mounter):
    nats_py_put(nats_url, bucket_name, "old/name.txt", b"renamed content")
    m = mounter(nats_url)
    b = m.path / bucket_name
    assert (b / "old" / "name.txt").read_bytes() == b"renamed content"
    # nats.go's UpdateMeta: the meta under the new name (same nuid), then a purge of the old meta subject.
    fixture_call(nats_url, rename_object, bucket_name, "old/name.txt", "new/name.txt")
    assert wait_for(lambda: exists(b / "new" / "name.txt") and not exists(b / "old"), T)
    assert (b / "new" / "name.txt").read_bytes() == b"renamed content"
    assert sorted(os.listdir(b)) == ["new"]


def test_raw_purge_of_a_meta_subject_is_noticed(nats_url, bucket_name, mounter):
    nats_py_put(nats_url, bucket_name, "purged.txt", b"p")
    nats_py_put(nats_url, bucket_name, "kept.txt", b"k")
    m = mounter(nats_url)
    b = m.path / bucket_name
    assert sorted(os.listdir(b)) == ["kept.txt", "purged.txt"]
    # No consumer ever delivers a purge: the periodic reconciliation finds it (every few seconds).
    with_store(nats_url, lambda s: s.streams.purge_subject(stream_name(bucket_name),
                                                           meta_subject(bucket_name, "purged.txt")))
    assert wait_for(lambda: not exists(b / "purged.txt"), T)
    assert os.listdir(b) == ["kept.txt"]


def test_buckets_appearing_and_disappearing_at_the_root(nats_url, bucket_name, mounter):
    m = mounter(nats_url)
    create_bucket(nats_url, bucket_name)
    nats_py_put(nats_url, bucket_name, "f", b"in a new bucket", create=False)
    assert wait_for(lambda: bucket_name in os.listdir(m.path), T)
    assert (m.path / bucket_name / "f").read_bytes() == b"in a new bucket"  # its index is now watched

    async def delete(nc, js):
        await js.delete_object_store(bucket_name)

    with_nats(nats_url, delete)
    assert wait_for(lambda: not exists(m.path / bucket_name), T)
    assert bucket_name not in os.listdir(m.path)
    assert wait_for(lambda: f"bucket {bucket_name} was deleted" in m.log()
                    or f"bucket {bucket_name} is gone" in m.log(), T)
    assert m.alive


# ---------------------------------------------------------------- open files under change
def _versions(n_chunks: int) -> tuple[bytes, bytes]:
    rnd = random.Random(n_chunks)
    old = b"".join(bytes([0x41 + i % 26]) * 131072 for i in range(n_chunks))  # "AAAA...BBBB..."
    return old, rnd.randbytes(n_chunks * 131072)


def _read_on(f, got: list[bytes]) -> bool:
    """Read `f` to its end into `got`; True if it ended with ESTALE."""
    while True:
        try:
            piece = f.read(1 << 20)
        except OSError as e:
            assert e.errno == errno.ESTALE, e
            return True
        if not piece:
            return False
        got.append(piece)


@pytest.mark.parametrize(("cache", "new_size"), [
    ("256MiB", 64), ("1MiB", 64),
    ("256MiB", 16),
])
def test_a_reader_keeps_its_version_or_gets_estale_never_a_mix(nats_url, bucket_name, mounter, cache, new_size):
    old, new = _versions(64)  # 8 MiB
    new = new[: new_size * 131072]  # the same size, or smaller: the reader must not see the new size either
    nats_py_put(nats_url, bucket_name, "moving.bin", old)
    m = mounter(nats_url, "--cache-size", cache)
    p = m.path / bucket_name / "moving.bin"
    with open(p, "rb", buffering=0) as f:
        got = [f.read(131072)]
        opened_mtime = os.fstat(f.fileno()).st_mtime_ns
        # Another client overwrites it: new chunks, new meta, the old chunks purged.
        nats_py_put(nats_url, bucket_name, "moving.bin", new)
        assert wait_for(lambda: os.stat(p).st_mtime_ns != opened_mtime, T)  # the mount has seen it
        stale = _read_on(f, got)
    data = b"".join(got)
    # What the reader got is a prefix of the version it opened: old bytes, then maybe ESTALE.
    assert data == old[: len(data)]
    assert stale or data == old
    assert wait_for(lambda: read_or_none(p) == new, T)  # a new open sees the new version
    assert m.alive


def test_a_read_of_a_version_found_purged_is_never_short(nats_url, bucket_name, mounter):
    """Once a read found the version a handle reads purged (another client overwrote it), every read of
    it fails ESTALE at its first byte, also where the mount still caches chunks of it. (The kernel, its
    read across a chunk boundary refused, asks again page by page and returns the pages it got: a
    `pread` in the middle of the file came back short, ending at the first chunk not cached, which
    programs take for the end of the file.)"""
    old, new = _versions(128)  # 16 MiB
    nats_py_put(nats_url, bucket_name, "moving.bin", old)
    m = mounter(nats_url)
    p = m.path / bucket_name / "moving.bin"
    fd = os.open(p, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # (the kernel reads only the pages asked for)
        assert os.pread(fd, 4096, 0) == old[:4096]  # the mount now caches the first chunks (its first walk)
        nats_py_put(nats_url, bucket_name, "moving.bin", new)  # new chunks, new meta, the old chunks purged
        with pytest.raises(OSError) as far:
            os.pread(fd, 4096, len(old) - 4096)  # (not cached: the mount learns the version is gone)
        assert far.value.errno == errno.ESTALE
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the kernel's pages go: it must ask the mount
        for off, size in [(0, len(old)), (100_000, 8 << 20), (4096, 4096)]:
            try:
                got = os.pread(fd, size, off)
            except OSError as e:
                assert e.errno == errno.ESTALE, e
                continue
            assert len(got) == size and got == old[off : off + size], (off, size, len(got))
    finally:
        os.close(fd)
    assert m.alive


def test_two_readers_of_two_versions_never_see_each_others_bytes(nats_url, bucket_name, mounter):
    old, new = _versions(64)
    nats_py_put(nats_url, bucket_name, "moving.bin", old)
    m = mounter(nats_url)
    p = m.path / bucket_name / "moving.bin"
    with open(p, "rb", buffering=0) as f:
        got = [f.read(131072)]
        nats_py_put(nats_url, bucket_name, "moving.bin", new)
        assert wait_for(lambda: read_or_none(p) == new, T)  # a second reader, of the new version
        stale = _read_on(f, got)
        assert read_or_none(p) == new
    data = b"".join(got)
    assert data == old[: len(data)]
    assert stale or data == old
    with open(p, "rb") as g:  # once the old reader is gone, the page cache serves the new version only
        assert g.read() == new


class HeldOpenMount(Mount):
    """A mount whose daemon holds one open where it awaits, on request (see held_open_daemon.py)."""

    def __init__(self, url: str, tmp_path: Path) -> None:
        (tmp_path / "mnt").mkdir()
        super().__init__(url, tmp_path / "mnt", [], log_file=tmp_path / "mount.log", cache_dir=tmp_path / "cache")
        self.control = tmp_path / "control"
        self.control.mkdir()

    def command(self) -> list[str]:
        launcher = Path(__file__).with_name("held_open_daemon.py")
        return [sys.executable, str(launcher), str(self.control), *super().command()[3:]]

    def hold_next_resolve_of(self, name: str) -> None:
        (self.control / "hold").write_text(name)

    def holding(self) -> bool:
        return (self.control / "held").exists()

    def release(self) -> None:
        (self.control / "release").touch()


def test_an_open_held_across_a_replace_never_shares_its_inode_with_the_other_version(nats_url, bucket_name,
                                                                                      tmp_path):
    """The interleaving behind the flake of the test above, forced: a second open of the inode an old
    reader holds is under way (the kernel's entry still points at that inode) while another client
    replaces the object and the mount sees it. Neither handle may read the other version's pages."""
    old, new = _versions(16)
    nats_py_put(nats_url, bucket_name, "moving.bin", old)
    m = HeldOpenMount(nats_url, tmp_path)
    m.start()
    try:
        p = m.path / bucket_name / "moving.bin"
        with open(p, "rb", buffering=0) as f:
            got = [f.read(131072)]
            opened_mtime = os.fstat(f.fileno()).st_mtime_ns
            m.hold_next_resolve_of("moving.bin")
            second: list[bytes] = []
            result: list[bool] = []
            opener = threading.Thread(target=lambda: result.append(_read_whole(p, second)))
            opener.start()
            assert wait_for(m.holding, T)  # the second open waits in the daemon
            nats_py_put(nats_url, bucket_name, "moving.bin", new)
            assert wait_for(lambda: os.stat(p).st_mtime_ns != opened_mtime, T)  # the mount has seen it
            m.release()
            opener.join(T)
            assert result, "the second reader did not finish"
            stale = _read_on(f, got)
        data = b"".join(got)
        assert data == old[: len(data)] and (stale or data == old)
        other = b"".join(second)
        # The second open reached the old inode: it reads the old version (or ESTALE), or, had it been
        # served after the change, the new one: never a mix.
        assert other in (old[: len(other)], new[: len(other)]) and (result[0] or other in (old, new))
        assert wait_for(lambda: read_or_none(p) == new, T)
        assert m.alive
    finally:
        m.stop()
    check_daemon_logs([m], [])


def _read_whole(p: Path, got: list[bytes]) -> bool:
    """Open `p` and read it to its end into `got`; True if it ended with ESTALE."""
    with open(p, "rb", buffering=0) as g:
        return _read_on(g, got)


def test_deleted_file_open_for_reading(nats_url, bucket_name, mounter):
    old, _ = _versions(16)
    nats_py_put(nats_url, bucket_name, "doomed.bin", old)
    m = mounter(nats_url, "--cache-size", "1MiB")
    p = m.path / bucket_name / "doomed.bin"
    with open(p, "rb", buffering=0) as f:
        assert f.read(4096) == old[:4096]
        fixture_call(nats_url, delete_object, bucket_name, "doomed.bin")
        assert wait_for(lambda: not exists(p), T)
        got: list[bytes] = []
        stale = _read_on(f, got)
        rest = b"".join(got)
        assert rest == old[4096 : 4096 + len(rest)]
        assert stale or rest == old[4096:]
        assert os.fstat(f.fileno()).st_size == len(old)


# ---------------------------------------------------------------- the server goes away
def test_index_survives_a_server_restart(private_server, bucket_name, mounter):
    url = private_server.url
    nats_py_put(url, bucket_name, "before.txt", b"written before the restart")
    nats_py_put(url, bucket_name, "dir/also.txt", b"also before")
    m = mounter(url)
    b = m.path / bucket_name
    assert (b / "before.txt").read_bytes() == b"written before the restart"
    listing = sorted(os.listdir(b))

    private_server.stop()
    # While the server is away, the tree is served from memory as it was: no phantom deletions.
    time.sleep(1.5)
    assert sorted(os.listdir(b)) == listing
    assert (b / "before.txt").read_bytes() == b"written before the restart"  # page cache
    private_server.start()  # same port, same store directory

    nats_py_put(url, bucket_name, "after.txt", b"written after the restart")
    assert wait_for(lambda: read_or_none(b / "after.txt") == b"written after the restart", 60)
    assert (b / "dir" / "also.txt").read_bytes() == b"also before"
    # Changes keep flowing: an overwrite and a delete after the restart.
    nats_py_put(url, bucket_name, "before.txt", b"overwritten after")
    fixture_call(url, delete_object, bucket_name, "dir/also.txt")
    assert wait_for(lambda: read_or_none(b / "before.txt") == b"overwritten after" and not exists(b / "dir"), T)
    assert m.alive


def test_bucket_deleted_and_created_again_behind_the_mount_is_rebuilt(nats_url, bucket_name, mounter):
    """The stream is deleted and created again behind the mount's back: the index starts over."""
    url = nats_url
    nats_py_put(url, bucket_name, "one.txt", b"1")
    nats_py_put(url, bucket_name, "two.txt", b"2")
    m = mounter(url, "--bucket", bucket_name)
    assert sorted(os.listdir(m.path)) == ["one.txt", "two.txt"]

    async def recreate(nc, js):
        await js.delete_object_store(bucket_name)

    with_nats(url, recreate)
    create_bucket(url, bucket_name)
    fixture_call(url, put_object, bucket_name, "two.txt", b"2 again")
    fixture_call(url, put_object, bucket_name, "three.txt", b"3")
    assert wait_for(lambda: sorted(os.listdir(m.path)) == ["three.txt", "two.txt"], T)
    assert (m.path / "two.txt").read_bytes() == b"2 again"
    assert m.alive


def test_a_reader_in_another_mount_racing_atomic_saves_reads_whole_versions(nats_url, bucket_name, mounter):
    """Atomic saves (write `.tmp`, rename it over `f`) in one mount while a thread reads `f` again and again
    through a second mount, which learns of each save through its watch. Every read returns one version,
    whole, at its own size (never the new bytes cut to, or padded with zeros up to, the size the kernel
    held for the old one), and no open fails with ENOENT. The one failure a reader in another mount can
    meet is ESTALE: the version it was reading had its chunks purged by the save."""
    create_bucket(nats_url, bucket_name)
    writer, reader = mounter(nats_url), mounter(nats_url)
    w, r = writer.path / bucket_name, reader.path / bucket_name
    (w / "f").write_bytes(saved_version(0))
    assert wait_for(lambda: read_or_none(r / "f") == saved_version(0), T)
    outcomes, bad = race_atomic_saves(w, r, 300, allowed=(errno.ESTALE,))
    assert not bad, f"{len(bad)} bad reads ({outcomes}): {bad[:5]}"
    assert outcomes["whole"] > 0
    assert wait_for(lambda: read_or_none(r / "f") == saved_version(300), T)


def _read_by(how: str, p: Path, scratch: Path) -> bytes:
    """Read all of `p` the way `how` does (each to end of file, never stopping at a size `stat` gave)."""
    if how == "reopen":
        os.close(os.open(p, os.O_RDONLY))  # pins the version, reads nothing
        return p.read_bytes()
    if how == "sendfile":
        out = scratch / "sendfile.out"
        with open(p, "rb") as src, open(out, "wb") as dst:
            offset = 0
            while sent := os.sendfile(dst.fileno(), src.fileno(), offset, 1 << 20):
                offset += sent
        return out.read_bytes()
    if how == "copyfile":  # fstat, then sendfile
        return Path(shutil.copyfile(p, scratch / "copyfile.out")).read_bytes()
    if how == "mmap":
        with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return bytes(mapped)
    assert how == "cp"  # copy_file_range, which falls back to splice, inside the mount
    subprocess.run(["cp", str(p), str(p) + ".copy"], check=True)
    return Path(str(p) + ".copy").read_bytes()


@pytest.mark.parametrize("new_size", [300_000, 40_000])
@pytest.mark.parametrize("how", ["reopen", "sendfile", "copyfile", "mmap", "cp"])
def test_a_reader_in_another_mount_whose_kernel_holds_the_old_size_reads_a_whole_version(
        nats_url, bucket_name, mounter, tmp_path, how, new_size):
    """Mount A replaces `f` by a bigger (or smaller) version while mount B's kernel still holds the old size for its
    inode (B's notifier, stopped here, has not delivered the invalidation: as when it is behind). B's
    daemon knows of the new version. Reading `f` in B to end of file by reopen and read, sendfile,
    shutil.copyfile, mmap, or `cp` inside B, gives the old version or the new one, whole: never the new
    bytes cut to the old size, or padded with zeros up to it. `cp`'s copy, as other clients read it, is whole too."""
    create_bucket(nats_url, bucket_name)
    writer, reader = mounter(nats_url), mounter(nats_url)
    w, r = writer.path / bucket_name, reader.path / bucket_name
    old, new = random.Random(1).randbytes(100_000), random.Random(2).randbytes(new_size)
    (w / "f").write_bytes(old)
    (w / "sync").mkdir()
    assert wait_for(lambda: read_or_none(r / "f") == old, T)
    assert os.stat(r / "f").st_size == len(old)  # B's kernel caches the attributes (60 s)
    assert reader.proc is not None
    notifier = daemon_children(reader.proc.pid)["notifier"]
    os.kill(notifier, signal.SIGSTOP)
    try:
        (w / "f.tmp").write_bytes(new)
        os.rename(w / "f.tmp", w / "f")
        (w / "sync" / "after").write_bytes(b"")
        # B's watch applies the bucket's changes in order: once it lists `after` (a directory of its own,
        # so that the listing hands B's kernel no attributes of `f`), it knows of the new `f`.
        assert wait_for(lambda: "after" in os.listdir(r / "sync"), T)
        assert os.stat(r / "f").st_size == len(old)  # the kernel still holds the old size
        got = _read_by(how, r / "f", tmp_path)
        assert got in (old, new), f"{len(got)} bytes, neither version ({len(old)} or {len(new)}) whole"
        if how == "cp":
            stored = nats_py_get(nats_url, bucket_name, "f.copy")
            assert stored in (old, new), f"cp stored {len(stored)} bytes, neither version whole"
    finally:
        os.kill(notifier, signal.SIGCONT)
    assert wait_for(lambda: read_or_none(r / "f") == new, T)


def test_getcwd_works_in_a_directory_just_made(nats_url, bucket_name, mounter, tmp_path):
    """mkdir D; cd D; getcwd: the mount's own new directory (and its later marker rewrites: a chmod, the
    directory times stored) never drops the kernel's entry of D, which would leave every process inside
    it with ENOENT from getcwd (git init: "unable to get current working directory")."""
    create_bucket(nats_url, bucket_name)
    m = mounter(nats_url)
    b = m.path / bucket_name
    home = os.getcwd()
    failures: list[str] = []
    try:
        for i in range(50):
            d = b / f"cwd{i}"
            os.mkdir(d)
            os.chdir(d)
            if i % 5 == 0:
                os.chmod(".", 0o700)  # (rewrites the empty directory's marker)
            if i % 10 == 0:
                Path("f").write_bytes(b"x")  # (the directory's times are stored later)
            for _ in range(20):
                try:
                    if os.getcwd() != str(d):
                        failures.append(f"{d}: getcwd names another directory")
                        break
                except OSError as e:
                    failures.append(f"{d}: getcwd: {e}")
                    break
                time.sleep(0.001)
            os.chdir(home)
        for i in range(3):  # a new bucket (mkdir at the root of an all-buckets mount)
            d = m.path / f"{bucket_name}_b{i}"
            os.mkdir(d)
            os.chdir(d)
            for _ in range(20):
                try:
                    os.getcwd()
                except OSError as e:
                    failures.append(f"{d}: getcwd: {e}")
                    break
                time.sleep(0.001)
            os.chdir(home)
            os.rmdir(d)
        assert failures == []
        if shutil.which("git"):
            repo = b / "repo"
            repo.mkdir()
            env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                   "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(tmp_path)}
            git = ["git", "-c", "init.defaultBranch=main"]
            subprocess.run([*git, "init", "-q", "."], cwd=repo, env=env, check=True, capture_output=True)
            for c in range(3):
                (repo / "sub").mkdir(exist_ok=True)
                (repo / "sub" / "f.txt").write_text(f"commit {c}\n")
                subprocess.run([*git, "add", "-A"], cwd=repo, env=env, check=True, capture_output=True)
                subprocess.run([*git, "commit", "-q", "-m", f"c{c}"], cwd=repo, env=env, check=True,
                               capture_output=True)
            log = subprocess.run([*git, "log", "--oneline"], cwd=repo, env=env, check=True, capture_output=True)
            assert len(log.stdout.splitlines()) == 3
    finally:
        os.chdir(home)
