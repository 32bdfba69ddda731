"""natsfs.fs.Operations without a kernel: attributes, listings, reads, links, statfs, xattrs, errors."""

from __future__ import annotations

import errno
import json
import os
import stat

import pyfuse3
import pytest
import trio
from gowriters import delete_object, put_link, put_object, rename_object
from opskit import CTX, ROOT, Env, Listing, errno_of

from natsfs.adr20 import ObjectStore, digest_of
from natsfs.core.filesystem import XATTR_STATS
from natsfs.memstreams import MemoryStreams

DATA = bytes(range(256)) * 1200  # 307200 bytes
UNEVEN = [1000, 131072, 17, 100000, 75111]


async def two_buckets(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("alpha", max_bytes=10 << 20)
    await store.create_bucket("beta")
    await put_object(ms, "alpha", "f.txt", b"hello alpha\n")
    await put_object(ms, "alpha", "dir/sub/deep.bin", DATA, chunk_sizes=UNEVEN)
    await put_object(ms, "alpha", "dir/empty", b"")
    await put_object(ms, "alpha", "marker/", b"")
    await put_object(ms, "beta", "b.txt", b"beta")


async def fuse_error(coro) -> int:
    with pytest.raises(pyfuse3.FUSEError) as e:
        await coro
    return errno_of(e.value)


# ---------------------------------------------------------------- lookups and attributes
def test_root_and_bucket_attributes(ops_env):
    async def body(env: Env):
        root = await env.ops.getattr(ROOT, None)
        assert stat.S_ISDIR(root.st_mode) and stat.S_IMODE(root.st_mode) == 0o755
        assert root.st_ino == ROOT and (root.st_uid, root.st_gid) == (1234, 5678)
        alpha = await env.ops.lookup(ROOT, b"alpha", None)
        assert stat.S_ISDIR(alpha.st_mode) and alpha.st_ino != ROOT
        assert env.fs.inodes.lookup_count(alpha.st_ino) == 1
        again = await env.ops.lookup(ROOT, b"alpha", None)
        assert again.st_ino == alpha.st_ino and env.fs.inodes.lookup_count(alpha.st_ino) == 2
        f = await env.ops.lookup(alpha.st_ino, b"f.txt", None)
        assert stat.S_ISREG(f.st_mode) and stat.S_IMODE(f.st_mode) == 0o644
        assert f.st_size == 12 and f.st_blocks == 1 and f.st_nlink == 1
        info = (await env.store.get_info("alpha", "f.txt"))
        assert f.st_mtime_ns == info.mtime_ns and f.st_mtime_ns > 1_600_000_000 * 10**9
        assert f.entry_timeout == env.config.entry_timeout and f.attr_timeout == env.config.attr_timeout
        got = await env.ops.getattr(f.st_ino, None)
        assert got.st_size == 12 and got.st_ino == f.st_ino
        deep = await env.lookup("alpha/dir/sub/deep.bin")
        assert deep.st_size == len(DATA)
        marker = await env.lookup("alpha/marker")
        assert stat.S_ISDIR(marker.st_mode)

    ops_env(body, setup=two_buckets)


@pytest.mark.parametrize("path", ["nope", "alpha/nope", "alpha/dir/nope", "a.b", "alpha/f.txt/below", "OBJ_alpha",
                                  "alpha/dir/sub/deep.bin/x"])
def test_missing_names_are_enoent(ops_env, path):
    async def body(env: Env):
        *parents, last = path.split("/")
        parent = (await env.lookup("/".join(parents))).st_ino if parents else ROOT
        assert await fuse_error(env.ops.lookup(parent, last.encode(), None)) == errno.ENOENT

    ops_env(body, setup=two_buckets)


def test_dot_lookups_are_left_to_the_kernel(ops_env):
    async def body(env: Env):
        alpha = await env.lookup("alpha")
        for name in (b".", b".."):
            assert await fuse_error(env.ops.lookup(alpha.st_ino, name, None)) == errno.ENOENT

    ops_env(body, setup=two_buckets)


def test_unknown_inode_is_estale(ops_env):
    async def body(env: Env):
        assert await fuse_error(env.ops.getattr(987654, None)) == errno.ESTALE
        assert await fuse_error(env.ops.lookup(987654, b"x", None)) == errno.ESTALE
        assert await fuse_error(env.ops.opendir(987654, None)) == errno.ESTALE
        assert await fuse_error(env.ops.open(987654, os.O_RDONLY, None)) == errno.ESTALE

    ops_env(body, setup=two_buckets)


# ---------------------------------------------------------------- directories
def test_readdir_of_root_bucket_and_subdirectory(ops_env):
    async def body(env: Env):
        root = await env.listdir(ROOT)
        assert root.names == ["alpha", "beta"]
        assert [i for _, _, i in root.entries] == [1, 2]
        alpha = await env.lookup("alpha")
        listing = await env.listdir(alpha.st_ino)
        assert listing.names == ["dir", "f.txt", "marker"]
        kinds = {n: stat.S_IFMT(a.st_mode) for n, a, _ in listing.entries}
        assert kinds == {"dir": stat.S_IFDIR, "f.txt": stat.S_IFREG, "marker": stat.S_IFDIR}
        sub = await env.lookup("alpha/dir")
        assert (await env.listdir(sub.st_ino)).names == ["empty", "sub"]
        assert (await env.listdir((await env.lookup("alpha/marker")).st_ino)).names == []

    ops_env(body, setup=two_buckets)


def test_readdir_raises_lookup_counts_and_attrs_match_lookup(ops_env):
    async def body(env: Env):
        alpha = await env.lookup("alpha")
        listing = await env.listdir(alpha.st_ino)
        for name, attr, _ in listing.entries:
            assert env.fs.inodes.lookup_count(attr.st_ino) == 1
            looked = await env.ops.lookup(alpha.st_ino, name.encode(), None)
            assert looked.st_ino == attr.st_ino and looked.st_mode == attr.st_mode and looked.st_size == attr.st_size
            assert env.fs.inodes.lookup_count(attr.st_ino) == 2
        # The kernel forgets what readdir handed out: the counts balance to zero and the inodes go.
        env.ops.forget([(a.st_ino, 2) for _, a, _ in listing.entries])
        for _, attr, _ in listing.entries:
            assert env.fs.inodes.lookup_count(attr.st_ino) == 0
            assert await fuse_error(env.ops.getattr(attr.st_ino, None)) == errno.ESTALE

    ops_env(body, setup=two_buckets)


def test_readdir_resumes_and_a_refused_entry_is_not_counted(ops_env):
    async def body(env: Env):
        alpha = await env.lookup("alpha")
        fh = await env.ops.opendir(alpha.st_ino, None)
        first = Listing(limit=1)
        await env.ops.readdir(fh, 0, first)
        assert first.names == ["dir"]
        assert first.entries[0][2] == 1
        known_before = len(env.fs.inodes)
        second = Listing()
        await env.ops.readdir(fh, first.entries[-1][2], second)
        assert second.names == ["f.txt", "marker"]
        await env.ops.releasedir(fh)
        # Only entries actually delivered were counted: each name exactly once.
        for name in ["dir", "f.txt", "marker"]:
            ino = env.fs.inodes.known(("alpha", name))
            assert ino is not None and env.fs.inodes.lookup_count(ino) == 1
        assert len(env.fs.inodes) == known_before + 2

    ops_env(body, setup=two_buckets)


def test_readdir_snapshot_is_stable_while_the_bucket_changes(ops_env):
    """The names are those of opendir: one created since is not added, one deleted since is left out
    (handed over, the kernel would keep an entry, and the mount an inode, for a name showing nothing)."""
    async def body(env: Env):
        alpha = await env.lookup("alpha")
        known_before = len(env.fs.inodes)
        fh = await env.ops.opendir(alpha.st_ino, None)
        await put_object(env.streams, "alpha", "aaa-new", b"x")
        await delete_object(env.streams, "alpha", "f.txt")
        await env.settle()
        listing = Listing()
        await env.ops.readdir(fh, 0, listing)
        assert listing.names == ["dir", "marker"]
        assert [next_id for _, _, next_id in listing.entries] == [1, 3]  # offsets stay those of the snapshot
        assert env.fs.inodes.known(("alpha", "f.txt")) is None
        await env.ops.releasedir(fh)
        assert (await env.listdir(alpha.st_ino)).names == ["aaa-new", "dir", "marker"]
        assert len(env.fs.inodes) <= known_before + 3

    ops_env(body, setup=two_buckets)


def test_readdir_from_the_start_again_lists_the_directory_as_it_is_now(ops_env):
    """rewinddir (lseek(fd, 0); Python's os.listdir(fd) does it on every call) on a handle that listed its
    directory: the next pass shows the directory as it is then, not the opendir snapshot (POSIX), also
    after the directory was renamed; one that was removed since lists empty."""
    async def body(env: Env):
        alpha = await env.lookup("alpha")
        fh = await env.ops.opendir(alpha.st_ino, None)
        first = Listing()
        await env.ops.readdir(fh, 0, first)
        assert first.names == ["dir", "f.txt", "marker"]
        await put_object(env.streams, "alpha", "aaa-new", b"x")
        await delete_object(env.streams, "alpha", "f.txt")
        await env.settle()
        again = Listing()
        await env.ops.readdir(fh, 0, again)
        assert again.names == ["aaa-new", "dir", "marker"]
        assert [next_id for _, _, next_id in again.entries] == [1, 2, 3]  # offsets of the new snapshot
        resumed = Listing()
        await env.ops.readdir(fh, 2, resumed)  # a pass goes on in the snapshot it started
        assert resumed.names == ["marker"]
        await env.ops.releasedir(fh)

        d = await env.lookup("alpha/dir")
        fh = await env.ops.opendir(d.st_ino, None)
        await env.ops.readdir(fh, 0, Listing())
        await env.ops.rename(alpha.st_ino, b"dir", alpha.st_ino, b"moved", 0, None)
        await put_object(env.streams, "alpha", "moved/added", b"y")
        await env.settle()
        moved = Listing()
        await env.ops.readdir(fh, 0, moved)
        assert moved.names == ["added", "empty", "sub"]
        assert moved.entries[0][1].st_ino == env.fs.inodes.known(("alpha", "moved", "added"))
        for name in ("added", "empty", "sub/deep.bin"):
            await delete_object(env.streams, "alpha", f"moved/{name}")
        await env.settle()
        gone = Listing()
        await env.ops.readdir(fh, 0, gone)
        assert gone.names == []
        await env.ops.releasedir(fh)

    ops_env(body, setup=two_buckets)


def test_readdir_of_a_directory_renamed_since_opendir_lists_it_where_it_is(ops_env):
    """`ls` of a directory renamed between opendir and readdir: its entries, under its new path (the
    kernel's entries hang off the directory's inode, which moved with it), and no inode for the old
    paths."""
    async def body(env: Env):
        d = await env.lookup("alpha/dir")
        fh = await env.ops.opendir(d.st_ino, None)
        alpha = await env.lookup("alpha")
        await env.ops.rename(alpha.st_ino, b"dir", alpha.st_ino, b"moved", 0, None)
        listing = Listing()
        await env.ops.readdir(fh, 0, listing)
        await env.ops.releasedir(fh)
        assert listing.names == ["empty", "sub"]
        sub = next(attr for name, attr, _ in listing.entries if name == "sub")
        assert sub.st_ino == env.fs.inodes.known(("alpha", "moved", "sub"))
        assert env.fs.inodes.known(("alpha", "dir", "sub")) is None
        assert env.fs.inodes.known(("alpha", "dir", "empty")) is None

    ops_env(body, setup=two_buckets)


@pytest.mark.expect_log(
    "readdir: bad directory handle",
    "read: bad file handle",
)
def test_opendir_on_a_file_is_enotdir_and_bad_handles_are_ebadf(ops_env):
    async def body(env: Env):
        f = await env.lookup("alpha/f.txt")
        assert await fuse_error(env.ops.opendir(f.st_ino, None)) == errno.ENOTDIR
        assert await fuse_error(env.ops.readdir(4242, 0, None)) == errno.EBADF
        assert await fuse_error(env.ops.read(4242, 0, 10)) == errno.EBADF
        fi = await env.ops.open(f.st_ino, os.O_RDONLY, None)
        assert await fuse_error(env.ops.readdir(fi.fh, 0, None)) == errno.EBADF
        await env.ops.release(fi.fh)
        dfh = await env.ops.opendir((await env.lookup("alpha")).st_ino, None)
        assert await fuse_error(env.ops.read(dfh, 0, 10)) == errno.EBADF

    ops_env(body, setup=two_buckets)


# ---------------------------------------------------------------- files
def test_open_read_release_byte_identical(ops_env):
    async def body(env: Env):
        assert await env.cat("alpha/f.txt") == b"hello alpha\n"
        assert await env.cat("alpha/dir/sub/deep.bin") == DATA
        assert await env.cat("alpha/dir/empty") == b""
        assert await env.cat("beta/b.txt") == b"beta"
        # Odd read sizes and offsets across uneven chunk boundaries.
        deep = await env.lookup("alpha/dir/sub/deep.bin")
        fi = await env.ops.open(deep.st_ino, os.O_RDONLY, None)
        for off, size in [(999, 2), (132_071, 20), (132_080, 100_010), (len(DATA) - 3, 100), (len(DATA), 10)]:
            assert await env.ops.read(fi.fh, off, size) == DATA[off : off + size]
        await env.ops.release(fi.fh)
        assert len(env.fs.handles) == 0

    ops_env(body, setup=two_buckets)


def test_reopen_keeps_page_cache_only_for_the_same_version(ops_env):
    async def body(env: Env):
        f = await env.lookup("alpha/f.txt")
        first = await env.ops.open(f.st_ino, os.O_RDONLY, None)
        # The kernel drops the pages for `first` only when it completes that open, after our answer: an
        # open answered before a read through `first` shows that drop done does not keep them (another
        # thread would read whatever they held before, another version's bytes in the middle of a read).
        second = await env.ops.open(f.st_ino, os.O_RDONLY, None)
        assert not first.keep_cache and not second.keep_cache
        assert await env.ops.read(second.fh, 0, 100) == b"hello alpha\n"
        third = await env.ops.open(f.st_ino, os.O_RDONLY, None)
        assert third.keep_cache  # the pages hold what reads of this version put there since the drop
        for fi in (first, second, third):
            await env.ops.release(fi.fh)
        # (Closed first: a reader still open would keep the old version on this inode, and the path
        # would get a fresh one; see test_ops_write.)
        await put_object(env.streams, "alpha", "f.txt", b"version two, longer\n")
        await env.settle()
        assert (await env.ops.getattr(f.st_ino, None)).st_size == 20
        assert ("inode", f.st_ino, None) in env.fs.kernel.sent  # the kernel drops its pages of it
        fourth = await env.ops.open(f.st_ino, os.O_RDONLY, None)
        assert not fourth.keep_cache
        assert await env.ops.read(fourth.fh, 0, 100) == b"version two, longer\n"
        await env.ops.release(fourth.fh)

    ops_env(body, setup=two_buckets)


def test_open_handle_of_a_replaced_version_reads_cached_bytes_until_found_purged(ops_env):
    async def body(env: Env):
        deep = await env.lookup("alpha/dir/sub/deep.bin")
        fi = await env.ops.open(deep.st_ino, os.O_RDONLY, None)
        assert await env.ops.read(fi.fh, 0, 10) == DATA[:10]
        await put_object(env.streams, "alpha", "dir/sub/deep.bin", b"replaced")  # purges the old chunks
        await env.settle()
        assert await env.ops.read(fi.fh, 0, 10) == DATA[:10]  # cached chunk of the version it opened
        def drops() -> int:
            return env.fs.kernel.sent.count(("inode", deep.st_ino, None))
        before = drops()
        assert await fuse_error(env.ops.read(fi.fh, 300_000, 100)) == errno.ESTALE
        # Found purged: not served from the cache any more either (the kernel, its read refused, asks
        # again page by page and would return those pages alone: a short read mid-file), and the
        # kernel's pages of it are dropped, once, for the same reason.
        assert await fuse_error(env.ops.read(fi.fh, 0, 10)) == errno.ESTALE
        assert await fuse_error(env.ops.read(fi.fh, 300_000, 100)) == errno.ESTALE
        assert drops() == before + 1
        await env.ops.release(fi.fh)
        assert await env.cat("alpha/dir/sub/deep.bin") == b"replaced"

    ops_env(body, setup=two_buckets, fetch_batch_bytes=128 * 1024, readahead_min=0, readahead_max=0)


@pytest.mark.expect_log("object c/bad.bin .*digest mismatch")
def test_corrupt_digest_gives_eio_on_the_last_read(ops_env):
    async def setup(ms, store):
        await store.create_bucket("c")
        await put_object(ms, "c", "bad.bin", DATA, chunk_sizes=UNEVEN, digest=digest_of(b"not the data"))
        await put_object(ms, "c", "good.bin", DATA, chunk_sizes=UNEVEN)

    async def body(env: Env):
        bad = await env.lookup("c/bad.bin")
        fi = await env.ops.open(bad.st_ino, os.O_RDONLY, None)
        off, size = 0, 128 * 1024
        while off + size < len(DATA):
            assert await env.ops.read(fi.fh, off, size) == DATA[off : off + size]
            off += size
        assert await fuse_error(env.ops.read(fi.fh, off, size)) == errno.EIO
        await env.ops.release(fi.fh)
        assert await env.cat("c/good.bin") == DATA
        with pytest.raises(pyfuse3.FUSEError) as e:
            await env.cat("c/bad.bin")
        assert e.value.errno == errno.EIO

    ops_env(body, setup=setup)


def test_read_only_mount_refuses_opens_for_writing_and_non_files_refuse_open(ops_env):
    async def body(env: Env):
        f = await env.lookup("alpha/f.txt")
        for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC, os.O_WRONLY | os.O_APPEND):
            assert await fuse_error(env.ops.open(f.st_ino, flags, None)) == errno.EROFS
        d = await env.lookup("alpha/dir")
        assert await fuse_error(env.ops.open(d.st_ino, os.O_RDONLY, None)) == errno.EISDIR
        assert await fuse_error(env.ops.open(ROOT, os.O_RDONLY, None)) == errno.EISDIR
        assert len(env.fs.handles) == 0

    ops_env(body, setup=two_buckets, read_only=True)


# ---------------------------------------------------------------- links
async def with_links(ms: MemoryStreams, store: ObjectStore) -> None:
    await two_buckets(ms, store)
    await put_link(ms, "alpha", "links/to-f", "alpha", "f.txt", style="go")
    await put_link(ms, "alpha", "links/js-to-deep", "alpha", "dir/sub/deep.bin", style="js")
    await put_link(ms, "alpha", "to-beta", "beta", None, style="js")
    await put_link(ms, "alpha", "go-to-beta-file", "beta", "b.txt", style="go")
    await put_link(ms, "alpha", "to-odd", "alpha", "../odd", style="go")


def test_readlink_in_a_multi_bucket_mount(ops_env):
    async def body(env: Env):
        expected = {
            "alpha/links/to-f": "../../alpha/f.txt",
            "alpha/links/js-to-deep": "../../alpha/dir/sub/deep.bin",
            "alpha/to-beta": "../beta",
            "alpha/go-to-beta-file": "../beta/b.txt",
            "alpha/to-odd": "../alpha/..%2Fodd",
        }
        for path, target in expected.items():
            attr = await env.lookup(path)
            assert stat.S_ISLNK(attr.st_mode), path
            assert attr.st_size == len(target.encode())
            assert await env.ops.readlink(attr.st_ino, None) == target.encode(), path
        f = await env.lookup("alpha/f.txt")
        assert await fuse_error(env.ops.readlink(f.st_ino, None)) == errno.EINVAL
        link = await env.lookup("alpha/links/to-f")
        assert await fuse_error(env.ops.open(link.st_ino, os.O_RDONLY, None)) == errno.ELOOP
        listing = await env.listdir((await env.lookup("alpha/links")).st_ino)
        assert all(stat.S_ISLNK(a.st_mode) for _, a, _ in listing.entries)

    ops_env(body, setup=with_links)


async def links_to_hidden_names(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    await put_object(ms, "b", "x//y", b"hidden by the real name")
    await put_object(ms, "b", "x%2F%2Fy", b"the real name")
    await put_object(ms, "b", "clash", b"hidden by the directory")
    await put_object(ms, "b", "clash/inner", b"inner")
    await put_object(ms, "b", "a//b", b"shown escaped")
    for name, target in (("to-hidden", "x//y"), ("to-real", "x%2F%2Fy"), ("to-clash", "clash"),
                         ("to-escaped", "a//b")):
        await put_link(ms, "b", name, "b", target, style="go")


def test_a_link_to_a_hidden_name_never_reaches_the_entry_that_hides_it(ops_env):
    """Following a link must reach its own object or nothing: where another entry holds the path its
    object would show at, the link dangles."""
    async def body(env: Env):
        expected = {"to-hidden": "nats-object:?/hidden-link", "to-clash": "nats-object:?/hidden-link",
                    "to-real": "x%2F%2Fy", "to-escaped": "a%2F%2Fb"}
        for name, target in expected.items():
            attr = await env.lookup(name)
            assert await env.ops.readlink(attr.st_ino, None) == target.encode(), name
        assert await env.cat("a%2F%2Fb") == b"shown escaped"

    ops_env(body, setup=links_to_hidden_names, bucket="b")


async def links_to_markers(ms: MemoryStreams, store: ObjectStore) -> None:
    await store.create_bucket("b")
    await put_object(ms, "b", "dm/", b"")  # a directory marker: shows as the directory dm
    await put_object(ms, "b", "dm/inner", b"inner")
    await put_object(ms, "b", "full/", b"bytes")  # not a marker (it has bytes): shows as the file full%2F
    for name, target in (("to-marker", "dm/"), ("to-full", "full/"), ("to-missing", "gone/")):
        await put_link(ms, "b", name, "b", target, style="go")


def test_a_link_to_a_directory_marker_leads_to_its_directory(ops_env):
    """A marker `dm/` shows as the directory `dm`; a link another client made to it (nats.go's AddLink
    takes any live object) read as `dm%2F`, a name that shows nothing, so it dangled."""
    async def body(env: Env):
        expected = {"to-marker": "dm", "to-full": "full%2F", "to-missing": "gone%2F"}
        for name, target in expected.items():
            attr = await env.lookup(name)
            assert await env.ops.readlink(attr.st_ino, None) == target.encode(), name
        assert (await env.listdir((await env.lookup("dm")).st_ino)).names == ["inner"]
        assert await env.cat("full%2F") == b"bytes"

    ops_env(body, setup=links_to_markers, bucket="b")


def test_readlink_in_a_single_bucket_mount(ops_env):
    async def body(env: Env):
        root = await env.ops.getattr(ROOT, None)
        assert stat.S_ISDIR(root.st_mode)
        assert (await env.listdir(ROOT)).names == ["dir", "f.txt", "go-to-beta-file", "links", "marker", "to-beta",
                                                   "to-odd"]
        expected = {
            "links/to-f": "../f.txt",
            "links/js-to-deep": "../dir/sub/deep.bin",
            "to-beta": "nats-object:beta/",
            "go-to-beta-file": "nats-object:beta/b.txt",
        }
        for path, target in expected.items():
            attr = await env.lookup(path)
            assert await env.ops.readlink(attr.st_ino, None) == target.encode(), path
            assert attr.st_size == len(target)
        assert await env.cat("dir/sub/deep.bin") == DATA

    ops_env(body, setup=with_links, bucket="alpha")


# ---------------------------------------------------------------- statfs, forget, xattrs
def test_statfs_single_bucket_uses_bucket_size_and_limit(ops_env):
    async def body(env: Env):
        st = await env.store.bucket_status("alpha")
        s = await env.ops.statfs(None)
        assert s.f_bsize == 4096 and s.f_frsize == 4096 and s.f_namemax == 255
        assert s.f_blocks == (10 << 20) // 4096
        assert s.f_bfree == s.f_bavail == ((10 << 20) - st.size) // 4096
        assert st.size > len(DATA)
        assert s.f_files == st.messages + 1_000_000

    ops_env(body, setup=two_buckets, bucket="alpha")


def test_statfs_of_a_single_bucket_mount_whose_bucket_was_deleted_is_an_empty_filesystem(ops_env):
    """The root of a --bucket mount stays an empty directory while its bucket does not exist: `statfs`
    answered ENOENT, so `df` failed on the mountpoint."""
    async def body(env: Env):
        await env.store.delete_bucket("alpha")
        s = await env.ops.statfs(None)
        assert s.f_bsize == 4096 and s.f_namemax == 255
        assert s.f_bfree == s.f_blocks and s.f_blocks * 4096 >= 1 << 49
        await env.store.create_bucket("alpha", max_bytes=1 << 20)  # and its own numbers once created again
        assert (await env.ops.statfs(None)).f_blocks == (1 << 20) // 4096

    ops_env(body, setup=two_buckets, bucket="alpha")


def test_statfs_multi_bucket_uses_account_limits(ops_env):
    async def body(env: Env):
        limits = await env.streams.account_limits()
        s = await env.ops.statfs(None)
        assert s.f_blocks == (1 << 30) // 4096
        assert s.f_bfree == ((1 << 30) - limits.storage_used) // 4096
        assert limits.storage_used > len(DATA)

    ops_env(body, setup=two_buckets, streams=MemoryStreams(max_storage=1 << 30))


def test_statfs_without_limits_reports_a_huge_free_space(ops_env):
    async def body(env: Env):
        s = await env.ops.statfs(None)
        assert s.f_bfree * 4096 >= 1 << 49

    ops_env(body, setup=two_buckets, bucket="beta")


@pytest.mark.expect_log(r"forget failed \(ignored\)")
def test_forget_never_raises(ops_env):
    async def body(env: Env):
        f = await env.lookup("alpha/f.txt")
        env.ops.forget([(999_999, 1), (ROOT, 7), (f.st_ino, 0)])
        env.ops.forget([(None, 1), ("junk", "x")])  # type: ignore[list-item]
        env.ops.forget(None)  # type: ignore[arg-type]
        env.ops.forget([(f.st_ino, 1), (f.st_ino, 1)])
        assert await fuse_error(env.ops.getattr(f.st_ino, None)) == errno.ESTALE
        assert (await env.ops.getattr(ROOT, None)).st_ino == ROOT
        again = await env.lookup("alpha/f.txt")
        assert again.st_ino == f.st_ino  # the same path gets its number back (st_ino stays stable)

    ops_env(body, setup=two_buckets)


def test_stats_count_the_server_calls_made_for_requests_apart(ops_env):
    """`server_calls_for_requests`: the server calls made while serving FUSE requests, per operation; a
    call of a background task (here: one made outside any request) counts in `server_calls` only."""

    async def body(env: Env):
        def stats() -> dict:
            return dict(json.loads(json.dumps(env.fs.stats())))  # (a copy, as the xattr gives it)

        before = stats()
        await env.cat("alpha/dir/sub/deep.bin")  # not cached: its read asks the server
        after_read = stats()
        read_calls = after_read["server_calls_for_requests"].get("read", 0)
        assert read_calls > before["server_calls_for_requests"].get("read", 0)
        await env.streams.stream_info("OBJ_alpha")  # outside any request
        after_background = stats()
        assert after_background["server_calls"]["stream_info"] == after_read["server_calls"].get("stream_info", 0) + 1
        assert after_background["server_calls_for_requests"] == after_read["server_calls_for_requests"]
        await env.cat("alpha/dir/sub/deep.bin")  # cached now: answered from memory
        assert stats()["server_calls_for_requests"] == after_background["server_calls_for_requests"]

    ops_env(body, setup=two_buckets)


def test_stats_xattr_on_the_root(ops_env):
    async def body(env: Env):
        await env.cat("alpha/dir/sub/deep.bin")
        raw = await env.ops.getxattr(ROOT, XATTR_STATS, None)
        stats = json.loads(raw)
        assert stats["cache"]["bytes_fetched"] == len(DATA)
        assert stats["cache"]["cached_bytes"] == env.cache.cached_bytes > 0
        assert stats["cache"]["cache_limit"] == 64 << 20
        assert stats["inodes"] == len(env.fs.inodes) and stats["handles"] == 0
        assert await env.ops.listxattr(ROOT, None) == []  # read by name only
        assert await fuse_error(env.ops.getxattr(ROOT, b"user.other", None)) == pyfuse3.ENOATTR
        f = await env.lookup("alpha/f.txt")
        assert await fuse_error(env.ops.getxattr(f.st_ino, XATTR_STATS, None)) == pyfuse3.ENOATTR
        assert b"user.nats.digest" not in await env.ops.listxattr(f.st_ino, None)  # read by name only
        assert await env.ops.getxattr(f.st_ino, b"user.nats.digest", None)

    ops_env(body, setup=two_buckets)


@pytest.mark.parametrize(
    ("op", "args"),
    [("mkdir", (ROOT, b"new", 0o755, CTX)), ("unlink", (ROOT, b"alpha", CTX)), ("rmdir", (ROOT, b"alpha", CTX)),
     ("rename", (ROOT, b"alpha", ROOT, b"gamma", 0, CTX)), ("create", (ROOT, b"x", 0o644, os.O_WRONLY, CTX)),
     ("write", (1, 0, b"data")), ("setattr", (ROOT, pyfuse3.EntryAttributes(), pyfuse3.SetattrFields(), None, CTX)),
     ("symlink", (ROOT, b"l", b"t", CTX)), ("link", (ROOT, ROOT, b"l", CTX)), ("mknod", (ROOT, b"n", 0o644, 0, CTX)),
     ("setxattr", (ROOT, b"user.x", b"v", None)), ("removexattr", (ROOT, b"user.x", None))],
)
def test_write_operations_are_erofs_on_a_read_only_mount(ops_env, op, args):
    async def body(env: Env):
        assert await fuse_error(getattr(env.ops, op)(*args)) == errno.EROFS
        assert (await env.listdir(ROOT)).names == ["alpha", "beta"]

    ops_env(body, setup=two_buckets, read_only=True)


# ---------------------------------------------------------------- failures
@pytest.mark.expect_log(
    r"failed unexpectedly: (RuntimeError\('unexpected'\)|KeyError\('surprise'\)|ZeroDivisionError)",
)
def test_unexpected_exception_is_eio_and_the_mount_keeps_working(ops_env):
    async def body(env: Env):
        env.streams.fail_next("account_limits", RuntimeError("unexpected"))
        assert await fuse_error(env.ops.statfs(None)) == errno.EIO
        assert (await env.ops.statfs(None)).f_bsize == 4096
        env.streams.fail_next("stream_names", KeyError("surprise"))
        assert await fuse_error(env.ops.opendir(ROOT, None)) == errno.EIO
        assert (await env.listdir(ROOT)).names == ["alpha", "beta"]
        env.streams.fail_next("stream_info", ZeroDivisionError())
        assert await fuse_error(env.ops.lookup(ROOT, b"gamma", None)) == errno.EIO
        env.streams.fail_next("last_msg", AttributeError("x"))
        assert await env.cat("alpha/f.txt") == b"hello alpha\n"  # served from memory: no server call

    ops_env(body, setup=two_buckets)


@pytest.mark.expect_log(r"statfs\(None,\) failed unexpectedly: RuntimeError\('unexpected'\)")
def test_unexpected_exception_in_statfs_single_bucket(ops_env):
    async def body(env: Env):
        env.streams.fail_next("stream_info", RuntimeError("unexpected"))
        assert await fuse_error(env.ops.statfs(None)) == errno.EIO
        assert (await env.ops.statfs(None)).f_blocks == (10 << 20) // 4096

    ops_env(body, setup=two_buckets, bucket="alpha")



@pytest.mark.expect_log("blew up", "fetching alpha/dir/sub/deep.bin failed unexpectedly")
@pytest.mark.parametrize("op", ["stream_batch", "get_batch", "subject_index"])
def test_unexpected_exception_while_reading_is_eio_and_reads_recover(ops_env, op):
    async def body(env: Env):
        deep = await env.lookup("alpha/dir/sub/deep.bin")
        fi = await env.ops.open(deep.st_ino, os.O_RDONLY, None)
        if op == "get_batch":  # the layout must be known for a chunk fetch by sequence
            assert await env.ops.read(fi.fh, 300_000, 10) == DATA[300_000:300_010]
        env.streams.fail_next(op, RuntimeError(f"{op} blew up"))
        off = 0 if op == "stream_batch" else 150_000
        assert await fuse_error(env.ops.read(fi.fh, off, 4096)) == errno.EIO
        assert await env.ops.read(fi.fh, off, 4096) == DATA[off : off + 4096]
        await env.ops.release(fi.fh)
        assert await env.cat("alpha/dir/sub/deep.bin") == DATA

    ops_env(body, setup=two_buckets, fetch_batch_bytes=128 * 1024, readahead_min=0, readahead_max=0)


@pytest.mark.expect_log("readahead of alpha/dir/sub/deep.bin failed unexpectedly", "statfs: server down")
def test_unexpected_exception_in_readahead_does_not_take_the_mount_down(ops_env):
    async def body(env: Env):
        deep = await env.lookup("alpha/dir/sub/deep.bin")
        fi = await env.ops.open(deep.st_ino, os.O_RDONLY, None)
        assert await env.ops.read(fi.fh, 150_000, 4096) == DATA[150_000:154_096]  # far: layout mapped, 1 chunk
        env.streams.fail_next("get_batch", RuntimeError("readahead blew up"))
        assert await env.ops.read(fi.fh, 154_096, 4096) == DATA[154_096:158_192]  # sequential: readahead starts
        await env.settle()
        assert not env.streams._faults  # the readahead met the failure
        assert await env.ops.read(fi.fh, 240_000, 4096) == DATA[240_000:244_096]
        await env.ops.release(fi.fh)

    ops_env(body, setup=two_buckets, fetch_batch_bytes=128 * 1024)


@pytest.mark.expect_log("statfs: server down")
def test_domain_errors_keep_their_errno(ops_env):
    from natsfs.errors import NoSpace, Unavailable

    async def body(env: Env):
        env.streams.fail_next("stream_info", Unavailable("server down"))
        assert await fuse_error(env.ops.statfs(None)) == errno.EIO
        env.streams.fail_next("stream_info", NoSpace("weird"))
        assert await fuse_error(env.ops.statfs(None)) == errno.ENOSPC

    ops_env(body, setup=two_buckets, bucket="alpha")


# ---------------------------------------------------------------- live changes
def test_live_puts_deletes_and_bucket_removal(ops_env):
    async def body(env: Env):
        alpha = await env.lookup("alpha")
        assert await env.cat("beta/b.txt") == b"beta"  # beta's index is loaded and watching
        await env.listdir(alpha.st_ino)
        await put_object(env.streams, "alpha", "live/new.txt", b"fresh")
        await env.settle()
        assert await env.cat("alpha/live/new.txt") == b"fresh"
        await delete_object(env.streams, "alpha", "live/new.txt")
        await env.settle()
        assert await fuse_error(env.ops.lookup(alpha.st_ino, b"live", None)) == errno.ENOENT
        await env.store.delete_bucket("beta")
        await env.settle()
        assert await fuse_error(env.ops.lookup(ROOT, b"beta", None)) == errno.ENOENT
        assert (await env.listdir(ROOT)).names == ["alpha"]
        await env.store.create_bucket("gamma")
        await put_object(env.streams, "gamma", "g", b"g!")
        assert (await env.listdir(ROOT)).names == ["alpha", "gamma"]
        assert await env.cat("gamma/g") == b"g!"


def test_unwatched_bucket_removal_is_seen_at_the_next_bucket_poll(ops_env):
    async def body(env: Env):
        assert (await env.lookup("beta")).st_ino
        await env.store.delete_bucket("beta")
        await env.ns.refresh_buckets()  # what the poll task does every poll_interval
        assert await fuse_error(env.ops.lookup(ROOT, b"beta", None)) == errno.ENOENT

    ops_env(body, setup=two_buckets)


def test_deleted_bucket_while_indexed_then_recreated(ops_env):
    async def body(env: Env):
        assert await env.cat("beta/b.txt") == b"beta"
        await env.store.delete_bucket("beta")
        await env.settle()
        await env.store.create_bucket("beta")
        await put_object(env.streams, "beta", "again.txt", b"second life")
        assert await env.cat("beta/again.txt") == b"second life"
        assert await fuse_error(env.ops.lookup((await env.lookup("beta")).st_ino, b"b.txt", None)) == errno.ENOENT

    ops_env(body, setup=two_buckets)


def test_a_bucket_mounts_root_stays_an_empty_directory_while_its_bucket_is_deleted(ops_env):
    """`--bucket alpha` and another client deletes alpha: the mountpoint shows an empty directory (it
    answered ENOENT: `ls` and `cd` of the mountpoint failed, and every process inside it), and the bucket's
    objects again once it is created again."""
    async def body(env: Env):
        assert (await env.listdir(ROOT)).names == ["dir", "f.txt", "marker"]
        await env.store.delete_bucket("alpha")
        await env.settle()
        for _ in range(2):  # (the second time without a watcher of the bucket left)
            assert stat.S_ISDIR((await env.ops.getattr(ROOT, None)).st_mode)
            assert (await env.listdir(ROOT)).names == []
            assert await fuse_error(env.ops.lookup(ROOT, b"f.txt", None)) == errno.ENOENT
        await env.store.create_bucket("alpha")
        await put_object(env.streams, "alpha", "again.txt", b"second life")
        await env.settle()
        assert (await env.listdir(ROOT)).names == ["again.txt"]
        assert await env.cat("again.txt") == b"second life"

    ops_env(body, setup=two_buckets, bucket="alpha")


def test_hostile_live_meta_is_skipped_and_the_mount_keeps_working(ops_env):
    async def body(env: Env):
        await env.lookup("alpha/f.txt")  # the index is loaded and watching
        await env.streams.publish("$O.alpha.M.YmFkLWpzb24=", b"{not json", {"Nats-Rollup": "sub"})
        await env.streams.publish("$O.alpha.M.bm8tbnVpZA==", b'{"name":"no-nuid","size":5,"chunks":1}')
        await env.settle()
        assert (await env.listdir((await env.lookup("alpha")).st_ino)).names == ["dir", "f.txt", "marker"]
        assert await env.cat("alpha/f.txt") == b"hello alpha\n"

    ops_env(body, setup=two_buckets)


def test_non_string_posix_metadata_does_not_take_the_mount_down(ops_env):
    async def body(env: Env):
        await env.lookup("alpha/f.txt")  # the index is loaded and watching
        doc = {"name": "evil", "bucket": "alpha", "nuid": "abc", "size": 1, "chunks": 1,
               "metadata": {"natsfs.mode": 420}}
        await env.streams.publish("$O.alpha.M.ZXZpbA==", json.dumps(doc).encode(), {"Nats-Rollup": "sub"})
        await env.settle()
        assert await env.cat("alpha/f.txt") == b"hello alpha\n"

    ops_env(body, setup=two_buckets)


def test_name_with_a_lone_surrogate_does_not_break_its_directory(ops_env):
    async def setup(ms, store):
        await two_buckets(ms, store)
        info = await put_object(ms, "alpha", "plain", b"x")
        # What nats-py/nats.js could write: a JSON name with an unpaired surrogate escape.
        doc = (b'{"name":"bad\\ud800name","bucket":"alpha","nuid":"' + info.nuid.encode()
               + b'","size":1,"chunks":1,"mtime":"0001-01-01T00:00:00Z"}')
        await ms.publish("$O.alpha.M.YmFk7aCAbmFtZQ==", doc, {"Nats-Rollup": "sub"})

    async def body(env: Env):
        alpha = await env.lookup("alpha")
        names = (await env.listdir(alpha.st_ino)).names
        assert {"dir", "f.txt", "marker", "plain"} <= set(names)

    ops_env(body, setup=setup)


def test_live_rename_by_another_client_removes_the_old_name(ops_env):
    async def body(env: Env):
        alpha = await env.lookup("alpha")
        await env.lookup("alpha/f.txt")  # the index is loaded and watching
        await rename_object(env.streams, "alpha", "f.txt", "g.txt")
        await env.settle()
        assert await env.cat("alpha/g.txt") == b"hello alpha\n"
        assert await fuse_error(env.ops.lookup(alpha.st_ino, b"f.txt", None)) == errno.ENOENT

    ops_env(body, setup=two_buckets)


def test_many_concurrent_reads_through_ops(ops_env):
    async def body(env: Env):
        deep = await env.lookup("alpha/dir/sub/deep.bin")
        results: dict[int, bytes] = {}

        async def reader(k: int) -> None:
            fi = await env.ops.open(deep.st_ino, os.O_RDONLY, None)
            off = (k * 37_001) % len(DATA)
            results[k] = await env.ops.read(fi.fh, off, 50_000)
            await env.ops.release(fi.fh)

        async with trio.open_nursery() as n:
            for k in range(16):
                n.start_soon(reader, k)
        for k, got in results.items():
            off = (k * 37_001) % len(DATA)
            assert got == DATA[off : off + 50_000]
        assert len(env.fs.handles) == 0

    ops_env(body, setup=two_buckets, streams=MemoryStreams(delay=0.0005))


@pytest.mark.parametrize("flag", [pyfuse3.RENAME_EXCHANGE, 1 << 2], ids=["RENAME_EXCHANGE", "RENAME_WHITEOUT"])
def test_rename_flags_it_cannot_honour_are_einval_and_move_nothing(ops_env, flag):
    """renameat2 with RENAME_WHITEOUT was taken as a plain rename: 0, the target replaced, and no
    whiteout left at the old name (overlayfs relies on one). Like RENAME_EXCHANGE it is refused."""

    async def body(env: Env) -> None:
        await put_object(env.streams, "alpha", "g.txt", b"g")
        await env.settle()
        alpha = await env.lookup("alpha")
        assert await fuse_error(env.ops.rename(alpha.st_ino, b"f.txt", alpha.st_ino, b"g.txt", flag, CTX)) \
            == errno.EINVAL
        assert await env.cat("alpha/f.txt") == b"hello alpha\n"
        assert await env.cat("alpha/g.txt") == b"g"
        assert {"f.txt", "g.txt"} <= set(await env.store.live_objects("alpha"))

    ops_env(body, setup=two_buckets)
