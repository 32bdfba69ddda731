"""Hostile metas (key case variants and duplicates of the known fields, nulls, wrong types, nested options and
links, unknown keys, odd numbers, invalid UTF-8, byte order marks, deep nesting, thousands of keys) generated
with Hypothesis and read by `parse_meta` and `load_meta`: only natsfs's own meta error ever comes out, a
rewrite never changes what nats.go reads, a wildcard nuid is always seen, and reading costs linear work."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from natsfs import adr20
from natsfs.adr20 import (
    MetaNotJSON,
    ObjectInfo,
    PosixAttrs,
    load_meta,
    meta_json,
    meta_subject,
    parse_meta,
    tombstone_doc,
    usable_fields,
    usable_nuid,
    wildcard_nuid,
    without_wildcard_nuid,
)
from natsfs.errors import MalformedMeta
from natsfs.streams import StoredMsg


# ---------------------------------------------------------------- a JSON text with everything Go's decoder takes
class Obj(tuple):
    """A JSON object's members in order, duplicates kept: (key, value) pairs; a key is a str or `Raw`."""


@dataclass(frozen=True)
class Num:
    """A number literal exactly as written (`-0`, `1e2`, 5000 digits, `NaN`)."""

    text: str


@dataclass(frozen=True)
class Raw:
    """A string's bytes between the quotes as written (invalid UTF-8 included)."""

    data: bytes


@dataclass(frozen=True)
class Deep:
    """`levels` arrays (or objects `{"a":...}`) nested around `inner`."""

    levels: int
    objects: bool
    inner: Any


@dataclass(frozen=True)
class Garbage:
    """Bytes that are no JSON value, where a value goes."""

    text: bytes


def render(node: Any, ascii_only: bool) -> bytes:
    if node is None:
        return b"null"
    if node is True:
        return b"true"
    if node is False:
        return b"false"
    if isinstance(node, Num):
        return node.text.encode()
    if isinstance(node, Raw):
        return b'"' + node.data + b'"'
    if isinstance(node, str):
        # ensure_ascii: lone surrogates as escapes; else as the bytes surrogatepass makes (no UTF-8)
        return json.dumps(node, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    if isinstance(node, Garbage):
        return node.text
    if isinstance(node, Deep):
        opening, closing = (b'{"a":', b"}") if node.objects else (b"[", b"]")
        return opening * node.levels + render(node.inner, ascii_only) + closing * node.levels
    if isinstance(node, Obj):
        return b"{" + b",".join(render(k, ascii_only) + b":" + render(v, ascii_only) for k, v in node) + b"}"
    assert isinstance(node, list)
    return b"[" + b",".join(render(v, ascii_only) for v in node) + b"]"


def depth(node: Any) -> int:
    """How deep `node` nests arrays and objects (Go takes 10000 levels)."""
    if isinstance(node, Deep):
        return node.levels + depth(node.inner)
    if isinstance(node, Obj):
        return 1 + max((depth(v) for _, v in node), default=0)
    if isinstance(node, list):
        return 1 + max((depth(v) for v in node), default=0)
    return 0


def garbage(node: Any) -> bool:
    """Whether `node` holds anything that is no JSON (Go refuses the whole meta then)."""
    if isinstance(node, Garbage):
        return True
    if isinstance(node, Num):
        return node.text in ("NaN", "Infinity", "-Infinity")
    if isinstance(node, Deep):
        return garbage(node.inner)
    if isinstance(node, Obj):
        return any(garbage(v) for _, v in node)
    if isinstance(node, list):
        return any(garbage(v) for v in node)
    return False


# ---------------------------------------------------------------- keys as Go matches them
_VARIANTS = {"s": "sS\u017f", "k": "kK\u212a"}


def key_variant(canonical: str) -> st.SearchStrategy[str]:
    """A key Go reads as the field `canonical`: any case of each letter, `ſ` for s, `K` (Kelvin) for k."""
    return st.tuples(*[st.sampled_from(_VARIANTS.get(c, c + c.upper() if c.isalpha() else c))
                       for c in canonical]).map("".join)


def lookalike(canonical: str) -> st.SearchStrategy[str]:
    """A key that is NOT the field to Go (dotless i, a space, a letter short)."""
    return st.sampled_from([canonical.replace("i", "\u0131"), canonical + " ", " " + canonical, canonical[:-1],
                            canonical.replace("_", "-"), canonical.upper() + "\u0301"])


def go_fold(key: str) -> str:
    return "".join({"\u017f": "S", "\u212a": "K"}.get(c, c.upper() if c.isascii() else c) for c in key)


# ---------------------------------------------------------------- values
NUMBER_TEXTS = ["-1", "-0", "0", "1", "1.5", "5.0", "1e2", "1E1", "-0.0", "0.0", str(2**32 - 1), str(2**32),
                str(2**63 - 1), str(2**63), str(2**64 - 1), str(2**64), "1" * 4300, "1" * 4301, "1" * 5000,
                "-" + "1" * 5000, "1e999", "-1e999", "1e-999", "123456789012345678901234567890.5"]
texts = st.one_of(
    st.sampled_from(["x", "y", "", "*", ">", "a.*", "a.>", "*.a", "abc", "ABCDEFGHIJKLMNOPQRSTUV", "a b", "a.b",
                     "\ud800", "\u2028<&>", "o"]),
    st.text(max_size=6),
    st.binary(max_size=6).filter(lambda b: b'"' not in b and b"\\" not in b and min(b, default=32) >= 32).map(Raw),
)
numbers = st.one_of(st.integers(-3, 2**64 + 3).map(lambda n: Num(str(n))), st.sampled_from(NUMBER_TEXTS).map(Num))
scalars = st.one_of(st.none(), st.booleans(), texts, numbers)
wrong_values = st.one_of(scalars, st.just([]), st.just(Obj()), st.just(["a", None]),
                         st.just(Obj((("a", "b"),))))


def deep_values(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Deep]:
    levels = st.sampled_from([1, 63, 64, 65, 500, 900, 990, 998, 999, 1000, 1001, 5000, 9998, 9999, 10000])
    return st.builds(Deep, levels, st.booleans(), inner)


junk_leaf = st.one_of(scalars, st.sampled_from(["NaN", "Infinity", "-Infinity"]).map(Num),
                      st.sampled_from([b"nope", b"[1,]", b"01", b'"\\x"', b"tru", b"{", b"]"]).map(Garbage))
junk = st.recursive(junk_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.lists(st.tuples(st.one_of(texts.filter(lambda t: isinstance(t, (str, Raw))), st.just("nuid")), inner),
             max_size=3).map(Obj),
    deep_values(inner),
), max_leaves=6)


def maybe(strategy: st.SearchStrategy[Any], right: float = 0.8) -> st.SearchStrategy[Any]:
    """Mostly a value of the right type, else null or one of the wrong type."""
    return st.one_of(strategy, strategy, strategy, st.none(), wrong_values, deep_values(scalars))


def uint(bits: int) -> st.SearchStrategy[Num]:
    return st.one_of(st.integers(0, 2**bits - 1).map(lambda n: Num(str(n))), numbers)


def members_of(fields: dict[str, st.SearchStrategy[Any]], size: int) -> st.SearchStrategy[Obj]:
    member = st.one_of(
        *[st.tuples(key_variant(name), value) for name, value in fields.items()],
        *[st.tuples(lookalike(name), value) for name, value in fields.items()],
        st.tuples(texts.filter(lambda t: isinstance(t, (str, Raw))), junk),
        st.tuples(st.sampled_from(["junk", "nuid", "Options"]), deep_values(junk_leaf)),
    )
    return st.lists(member, max_size=size).map(Obj)


link_values = maybe(members_of({"bucket": maybe(texts), "name": maybe(texts)}, 4))
options_values = maybe(members_of({"link": link_values, "max_chunk_size": maybe(uint(32))}, 4))
header_maps = maybe(st.lists(st.tuples(texts.filter(lambda t: isinstance(t, str)),
                                       maybe(st.lists(st.one_of(st.none(), texts), max_size=2))),
                             max_size=3).map(Obj))
metadata_maps = maybe(st.lists(st.tuples(st.one_of(st.sampled_from(sorted(adr20._ATTR_KEYS)), st.text(max_size=4)),
                                         maybe(st.one_of(texts, st.sampled_from(["644", "0", "-5", "1" * 30])))),
                               max_size=4).map(Obj))
META_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "name": maybe(st.sampled_from(["x", "x", "y", "\ud800", "a\u2028"])), "description": maybe(texts),
    "headers": header_maps, "metadata": metadata_maps, "options": options_values, "bucket": maybe(texts),
    "nuid": maybe(texts), "size": maybe(uint(64)), "mtime": maybe(texts), "chunks": maybe(uint(32)),
    "digest": maybe(texts), "deleted": maybe(st.booleans()),
}
BASE = (("name", "x"), ("bucket", "b"), ("nuid", "abc"), ("size", Num("0")), ("chunks", Num("0")))


@st.composite
def documents(draw: st.DrawFn) -> Obj:
    base = draw(st.lists(st.sampled_from(BASE), max_size=5, unique=True))
    extra = draw(members_of(META_FIELDS, 10))
    members = [*base, *extra]
    if draw(st.booleans()):
        members = draw(st.permutations(members))
    return Obj(members)


@dataclass(frozen=True)
class Bulk:
    """Thousands of members of one kind, appended to a document (huge key counts, repeated merges)."""

    count: int
    kind: str
    last: str


BULK_KINDS = ["nuid", "options", "link", "headers", "metadata", "unknown", "bad-headers"]


def bulk_members(bulk: Bulk) -> list[tuple[str, Any]]:
    keys = ["nuid", "NUID", "Nuid", "nUiD"]
    n = bulk.count
    if bulk.kind == "nuid":
        return [(keys[i % 4], "abc" if i % 3 else None) for i in range(n)] + [("NuId", bulk.last)]
    if bulk.kind == "options":
        return [("options", Obj([(f"k{i}", Num("1")) for i in range(n)]))] + [("Options", Obj())] * n
    if bulk.kind == "link":
        return [("options", Obj([("link", Obj([("bucket", "o"), *((f"k{i}", Num("1")) for i in range(n))])),
                                 *(("LINK", Obj()) for _ in range(n))]))]
    if bulk.kind in ("headers", "bad-headers"):
        value = Num("1") if bulk.kind == "bad-headers" else ["1"]
        return [("headers", Obj([(f"k{i}", value) for i in range(n)]))] + [("Headers", Obj())] * n
    if bulk.kind == "metadata":
        return [("metadata", Obj([(f"k{i}", Num("1")) for i in range(n)]))] + [("METADATA", Obj())] * n
    return [(f"k{i}", Num("1")) for i in range(n)] + [("nuid", bulk.last)]


@dataclass(frozen=True)
class Bytes:
    """How the document's text is mangled: a byte order mark, UTF-16, what follows it."""

    ascii_only: bool
    prefix: bytes
    suffix: bytes
    utf16: bool


VALID_SUFFIXES = [b"", b" ", b"\n\t\r "]
VALID_PREFIXES = [b"", b" \n"]
byte_forms = st.builds(Bytes, st.booleans(),
                       st.sampled_from([*VALID_PREFIXES, *VALID_PREFIXES, b"\xef\xbb\xbf", b"\xff"]),
                       st.sampled_from([*VALID_SUFFIXES, *VALID_SUFFIXES, b"x", b"\xc2\xa0", b"\x0b", b"}", b"{}"]),
                       st.sampled_from([False] * 7 + [True]))


def encode(doc: Obj, form: Bytes) -> tuple[bytes, bool]:
    """The meta's bytes, and whether Go's decoder takes them as JSON at all."""
    data = form.prefix + render(doc, form.ascii_only) + form.suffix
    go_json = (form.prefix in VALID_PREFIXES and form.suffix in VALID_SUFFIXES and depth(doc) <= 10_000
               and not garbage(doc))
    if form.utf16:
        data, go_json = data.decode("utf-8", "surrogateescape").encode("utf-16", "surrogatepass"), False
    return data, go_json


# ---------------------------------------------------------------- reading and the oracles
def msg(data: bytes, name: str = "x") -> StoredMsg:
    return StoredMsg(3, meta_subject("b", name), {}, data, 1_700_000_000_000_000_000)


def at_stack_depth(frames: int, call: Any) -> Any:
    """`call()` from `frames` frames deeper (the daemon reads metas deep in trio's stack)."""
    return call() if frames <= 0 else at_stack_depth(frames - 1, call)


def read(data: bytes, name: str, frames: int = 0) -> ObjectInfo | MalformedMeta:
    """parse_meta's answer: the object or its MalformedMeta; anything else it raises fails the test."""
    try:
        return at_stack_depth(frames, lambda: parse_meta("b", msg(data, name), lambda _: None))
    except MalformedMeta as e:
        return e


def subject_name(data: bytes, use_own: bool) -> str:
    """The name whose subject the meta is under: mostly the one it holds, so the rest of it is checked."""
    try:
        name = load_meta(data)[0].get("name")
    except MetaNotJSON:
        return "x"
    if use_own and isinstance(name, str) and name.isprintable():
        try:
            name.encode()
            return name
        except UnicodeEncodeError:
            pass
    return "x"


_MISSING = object()


def go_last(doc: Obj, field: str) -> Any:
    """What Go leaves in a top-level string, number or boolean field: the last non-null value of a key
    that folds to it (`_MISSING`: none)."""
    value = _MISSING
    for key, v in doc:
        if isinstance(key, str) and go_fold(key) == go_fold(field) and v is not None:
            value = v
    return value


def seen(info: ObjectInfo) -> tuple[Any, ...]:
    # (POSIX attributes all unusable, dropped by the rewrite, read as none: the defaults apply either way)
    return (info.name, info.nuid, info.wildcard_nuid, info.size, info.chunks, info.digest, info.deleted,
            info.link, info.chunk_size, info.attrs if info.attrs != PosixAttrs() else None)


def check_canonical(written: dict[str, Any]) -> None:
    """A rewrite holds each known field once, under its lower-case key, in every struct."""
    for struct, fields in ((written, adr20._META_FIELDS), (written.get("options"), adr20._OPTIONS_FIELDS),
                           ((written.get("options") or {}).get("link"), adr20._LINK_FIELDS)):
        if isinstance(struct, dict):
            folded = {go_fold(f) for f in fields}
            assert not [k for k in struct if k not in fields and go_fold(k) in folded], struct


def check(doc: Obj, form: Bytes, use_own: bool, frames: int) -> None:
    data, go_json = encode(doc, form)
    name = subject_name(data, use_own)
    info = read(data, name, frames)
    # 1. only MalformedMeta comes out (read() lets anything else fail the test), and every meta Go refuses
    #    as JSON is one natsfs skips too
    if not go_json:
        assert isinstance(info, MalformedMeta), (data[:200], info)
    if isinstance(info, MalformedMeta):
        return
    # 3. the object has the string, number and boolean fields Go leaves there
    for field in ("name", "nuid", "size", "chunks", "digest", "deleted"):
        value = go_last(doc, field)
        if value is _MISSING or isinstance(value, Raw) or (isinstance(value, str) and not value.isprintable()):
            continue
        if field == "nuid":
            assert info.wildcard_nuid == (value if wildcard_nuid(value) else ""), (value, info)
            assert info.nuid == (value if usable_nuid(value) else ""), (value, info)
        elif field in ("size", "chunks"):
            assert getattr(info, field) == int(value.text)
        elif field != "deleted" or value is True:  # (`deleted: false` is the zero value)
            assert getattr(info, field) == value, (field, value, info)
    # 2. a rewrite (each field under its lower-case key, as nats.go read it) reads as the same object
    # (read and written as deep in the stack as the daemon's rewrites read and write it)
    loaded = at_stack_depth(frames, lambda: load_meta(data)[0])
    rewritten = at_stack_depth(frames, lambda: meta_json(usable_fields(loaded)))
    written = json.loads(rewritten)  # (Python's strict parser: no NaN, no huge number, no lone surrogate)
    check_canonical(written)
    again = read(rewritten, name)
    assert isinstance(again, ObjectInfo), again
    assert seen(again) == seen(info)
    assert meta_json(usable_fields(load_meta(rewritten)[0])) == rewritten
    # ... also on a fresh nuid in place of a wildcard (the rewrite of `defuse_wildcard_nuid`) ...
    defused = read(meta_json(without_wildcard_nuid(usable_fields(loaded))), name)
    assert isinstance(defused, ObjectInfo) and not defused.wildcard_nuid, defused
    assert seen(defused)[3:] == seen(info)[3:] and defused.name == info.name
    if info.wildcard_nuid:
        assert usable_nuid(defused.nuid) and defused.nuid != info.nuid
    # ... and as a tombstone of it (a delete)
    tomb = read(meta_json(tombstone_doc("b", info.name, usable_fields(loaded))), name)
    assert isinstance(tomb, ObjectInfo) and tomb.deleted and (tomb.name, tomb.link) == (info.name, info.link)


# (NATSFS_FUZZ_EXAMPLES=5000 for a longer run by hand)
FUZZ = settings(max_examples=int(os.environ.get("NATSFS_FUZZ_EXAMPLES", "250")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(documents(), byte_forms, st.booleans(), st.sampled_from([0, 0, 0, 100, 300, 600]))
def test_hostile_metas_read_as_nats_go_reads_them(doc, form, use_own, frames):
    check(doc, form, use_own, frames)


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(["junk", "Options", "description", "metadata", "headers", "NUID"]),
                          deep_values(junk)), min_size=1, max_size=3),
       st.lists(st.sampled_from([("NUID", "*"), ("nuid", ">"), ("OPTIONS", Obj((("link", Obj((("bucket", "o"),))),))),
                                 ("deleted", True)]), max_size=2),
       byte_forms, st.sampled_from([0, 0, 100, 300, 600]))
def test_deep_values(deep, more, form, frames):
    check(Obj([*BASE, *deep, *more]), form, True, frames)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents(), st.builds(Bulk, st.sampled_from([1000, 3000]), st.sampled_from(BULK_KINDS),
                              st.sampled_from(["*", ">", "abc", "a.*"])))
def test_thousands_of_keys(doc, bulk):
    check(Obj([*doc, *bulk_members(bulk)]), Bytes(True, b"", b"", False), True, 0)


@pytest.mark.parametrize("key", ["nuid", "NUID", "Nuid", "NuID"])
@pytest.mark.parametrize("before", [(), (("nuid", "abc"),), (("NUID", "abc"), ("nuid", None))])
def test_the_last_folded_nuid_key_holding_a_wildcard_is_always_flagged(key, before):
    data = render(Obj([*BASE[:2], *before, (key, "*"), ("Nuid", None)]), True)
    info = read(data, "x")
    assert isinstance(info, ObjectInfo) and (info.nuid, info.wildcard_nuid) == ("", "*")

