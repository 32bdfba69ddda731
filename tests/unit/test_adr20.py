"""adr20: meta parsing with every client's quirks, subject tokens, digests."""

from __future__ import annotations

import base64
import hashlib
import json

import pytest

from natsfs import xattrs
from natsfs.adr20 import (
    Link,
    decode_token,
    digest_of,
    encode_name,
    format_digest,
    meta_subject,
    parse_digest,
    parse_meta,
    skipped_wildcard_nuid,
    usable_fields,
    valid_bucket_name,
)
from natsfs.errors import MalformedMeta
from natsfs.streams import StoredMsg

TS = 1_700_000_000_123_456_789
HELLO_DIGEST = "SHA-256=-H6CURjrqvpYrE8uyh09eei2ZBqqxNqER_cA-N1yW1A="


def msg(name: str, doc: dict | bytes | str, *, seq: int = 7, subject: str | None = None) -> StoredMsg:
    data = doc if isinstance(doc, bytes) else (doc if isinstance(doc, str) else json.dumps(doc)).encode()
    return StoredMsg(seq, subject or meta_subject("b", name), {"Nats-Rollup": "sub"}, data, TS)


def test_nats_go_meta_zero_mtime_uses_message_time():
    raw = (b'{"name":"go/hello.txt","description":"put by nats.go","options":{"max_chunk_size":131072},'
           b'"bucket":"interop","nuid":"XJUQgBOZuHryLbuazQNi9y","size":14,"mtime":"0001-01-01T00:00:00Z",'
           b'"chunks":1,"digest":"SHA-256=-H6CURjrqvpYrE8uyh09eei2ZBqqxNqER_cA-N1yW1A="}')
    info = parse_meta("b", msg("go/hello.txt", raw, seq=2))
    assert (info.name, info.nuid, info.size, info.chunks) == ("go/hello.txt", "XJUQgBOZuHryLbuazQNi9y", 14, 1)
    assert info.mtime_ns == TS
    assert info.revision == 2
    assert info.digest == HELLO_DIGEST
    assert info.chunk_size == 131072
    assert info.link is None and not info.deleted and info.attrs is None
    assert info.bucket == "b"


@pytest.mark.parametrize("mtime", ["2026-11-21T22:35:45.512982+00:00", "", None, "garbage", 12])
def test_wire_mtime_is_ignored(mtime):
    doc = {"name": "py/x.txt", "bucket": "b", "nuid": "ai8ouFdaJeGol96Lh0S24H", "size": 12, "mtime": mtime,
           "chunks": 1, "digest": "", "deleted": False}
    info = parse_meta("b", msg("py/x.txt", doc))
    assert info.mtime_ns == TS
    assert info.size == 12


def test_nats_py_tombstone_with_empty_mtime_and_digest():
    doc = {"name": "py/deleted.txt", "bucket": "b", "nuid": "ai8ouFdaJeGol96Lh0S2Np", "size": 0, "mtime": "",
           "chunks": 0, "digest": "", "deleted": True, "options": {"max_chunk_size": 131072}}
    info = parse_meta("b", msg("py/deleted.txt", doc))
    assert info.deleted
    assert info.digest == ""


def test_nats_js_link_without_nuid_size_chunks():
    doc = {"name": "js/link-to-a", "bucket": "interop", "options": {"link": {"bucket": "interop", "name": "js/a.txt"}}}
    info = parse_meta("interop", msg("js/link-to-a", doc, subject=meta_subject("interop", "js/link-to-a")))
    assert info.link == Link("interop", "js/a.txt")
    assert (info.nuid, info.size, info.chunks) == ("", 0, 0)
    assert not info.deleted


def test_bucket_link_has_no_name():
    doc = {"bucket": "interop", "nuid": "iEUW3CnYSml1Gn16NNo3TT", "size": 0, "chunks": 0, "name": "js/bucket-link",
           "description": "", "options": {"link": {"bucket": "other"}, "max_chunk_size": 131072}}
    info = parse_meta("b", msg("js/bucket-link", doc))
    assert info.link == Link("other", None)


def test_link_with_empty_name_is_a_bucket_link():
    doc = {"name": "l", "options": {"link": {"bucket": "other", "name": ""}}}
    assert parse_meta("b", msg("l", doc)).link == Link("other", None)


def test_link_without_bucket_is_not_a_link():
    doc = {"name": "l", "nuid": "abc", "size": 0, "chunks": 0, "options": {"link": {"name": "x"}}}
    assert parse_meta("b", msg("l", doc)).link is None


@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b"[1, 2]", b'"a string"', b"null", b"42"])
def test_unusable_payloads_are_malformed(raw):
    with pytest.raises(MalformedMeta):
        parse_meta("b", msg("bad-json", raw))


def test_bad_json_message_names_subject_and_seq():
    with pytest.raises(MalformedMeta, match=r"is not JSON") as e:
        parse_meta("b", msg("bad-json", b"{not json", seq=65))
    assert "65" in str(e.value)


def test_missing_nuid_with_chunks_is_malformed():
    with pytest.raises(MalformedMeta, match="no nuid"):
        parse_meta("b", msg("no-nuid", {"name": "no-nuid", "bucket": "b", "size": 5, "chunks": 1}))


def test_missing_nuid_on_empty_object_is_fine():
    info = parse_meta("b", msg("e", {"name": "e", "bucket": "b", "size": 0, "chunks": 0}))
    assert (info.nuid, info.size) == ("", 0)


@pytest.mark.parametrize(
    "doc",
    [
        {"name": "x", "nuid": "../etc", "size": 1, "chunks": 1},
        {"name": "x", "nuid": "a.b", "size": 1, "chunks": 1},
        {"name": "x", "nuid": "a>", "size": 1, "chunks": 1},
        {"name": "x", "nuid": 5, "size": 1, "chunks": 1},
        {"name": "x", "nuid": "abc", "size": -1, "chunks": 1},
        {"name": "x", "nuid": "abc", "size": "12", "chunks": 1},
        {"name": "x", "nuid": "abc", "size": True, "chunks": 1},
        {"name": "x", "nuid": "abc", "size": 1.5, "chunks": 1},
        {"name": "x", "nuid": "abc", "size": 10, "chunks": 0},
        {"name": "x", "nuid": "abc", "size": 10, "chunks": -2},
    ],
)
def test_bad_fields_are_malformed(doc):
    with pytest.raises(MalformedMeta):
        parse_meta("b", msg("x", doc))


def test_name_subject_mismatch_is_malformed():
    doc = {"name": "other.txt", "nuid": "abc", "size": 1, "chunks": 1}
    with pytest.raises(MalformedMeta, match="subject"):
        parse_meta("b", msg("x.txt", doc))


def test_name_comes_from_subject_when_missing():
    info = parse_meta("b", msg("from-subject.txt", {"nuid": "abc", "size": 1, "chunks": 1}))
    assert info.name == "from-subject.txt"


def test_no_name_anywhere_is_malformed():
    with pytest.raises(MalformedMeta, match="no name"):
        parse_meta("b", msg("", {"nuid": "abc", "size": 1, "chunks": 1}, subject="$O.b.M.!!!notbase64"))


def test_unpadded_subject_token_matches_name():
    subject = "$O.b.M." + encode_name("ab").rstrip("=")
    info = parse_meta("b", msg("ab", {"name": "ab", "nuid": "n", "size": 1, "chunks": 1}, subject=subject))
    assert info.name == "ab"


def test_null_fields_are_tolerated():
    """null is the zero value for nats.go: an absent field, an empty string in a map or list."""
    doc = {"name": "x", "nuid": "abc", "size": 3, "chunks": None, "digest": None, "options": None,
           "metadata": None, "headers": None, "description": None, "mtime": None, "deleted": None, "bucket": None}
    with pytest.raises(MalformedMeta):  # chunks None -> 0 with size 3
        parse_meta("b", msg("x", doc))
    doc["chunks"] = 1
    info = parse_meta("b", msg("x", doc))
    assert info.digest == "" and info.attrs is None and info.chunk_size == 0 and not info.deleted
    doc |= {"options": {"link": None, "max_chunk_size": None}, "metadata": {"natsfs.mode": None, "k": None},
            "headers": {"H": None, "I": [None, "v"]}}
    info = parse_meta("b", msg("x", doc))
    assert info.link is None and info.chunk_size == 0 and info.attrs is not None and info.attrs.mode is None
    link = parse_meta("b", msg("l", {"name": "l", "options": {"link": {"bucket": "b", "name": None}}}))
    assert link.link == Link("b", None)


# Metas another client wrote with a field that decides what the object is (name, bucket, nuid, size,
# chunks, digest, deleted, the link) of the wrong JSON type: nats.go's json.Unmarshal into its typed
# ObjectInfo fails on each (GetInfo: ErrBadObjectMeta; Watch and List skip it), so they are malformed here
# too, never turned into text.
STRICT_WRONG_TYPES = {
    "name-number": {"name": 5},
    "name-list": {"name": ["x"]},
    "link-string": {"options": {"link": "str"}},
    "link-list": {"options": {"link": ["b", "a"]}},
    "link-bucket-number": {"options": {"link": {"bucket": 7, "name": "a"}}},
    "link-name-list": {"options": {"link": {"bucket": "b", "name": ["a"]}}},
    "link-both": {"options": {"link": {"bucket": 7, "name": ["a"]}}},
    "bucket-number": {"bucket": 7},
    "nuid-number": {"nuid": 12},
    "size-string": {"size": "1"},
    "size-float": {"size": 1.0},
    "size-bool": {"size": True},
    "chunks-string": {"chunks": "1"},
    "digest-number": {"digest": 5},
    "deleted-string": {"deleted": "false"},
    "deleted-number": {"deleted": 1},
}


@pytest.mark.parametrize("case", sorted(STRICT_WRONG_TYPES))
def test_a_field_that_decides_what_the_object_is_of_the_wrong_json_type_is_malformed(case):
    doc = {"name": "x", "bucket": "b", "nuid": "abc", "size": 1, "chunks": 1, "mtime": "0001-01-01T00:00:00Z",
           "digest": HELLO_DIGEST} | STRICT_WRONG_TYPES[case]
    with pytest.raises(MalformedMeta, match=r"is not one nats\.go can read"):
        parse_meta("b", msg("x", doc))


def test_the_testers_hostile_metas():
    """typ1: a name that is a number (was listed under its subject's name) and typ5: a link whose bucket
    is a number and name a list (was shown as the symlink `../7/['a']`) are malformed; typ4's link that
    is a string too. typ3 (options a string, metadata a list) and typ6 (a symlink target that is a
    number) only have descriptive fields of the wrong type: shown, those fields ignored."""
    with pytest.raises(MalformedMeta, match=r"for 'typ1' .* its name is 5, not a string"):
        parse_meta("h", msg("typ1", {"name": 5, "nuid": "T1", "size": 1, "chunks": 1}))
    typ5 = {"name": "typ5", "nuid": "T5", "size": 1, "chunks": 1, "options": {"link": {"bucket": 7, "name": ["a"]}}}
    with pytest.raises(MalformedMeta, match=r"its options\.link\.bucket is 7, not a string"):
        parse_meta("h", msg("typ5", typ5))
    typ4 = {"name": "typ4", "nuid": "T4", "size": 1, "chunks": 1, "mtime": "garbage", "options": {"link": "str"}}
    with pytest.raises(MalformedMeta, match=r"its options\.link is 'str', not an object"):
        parse_meta("h", msg("typ4", typ4))
    why: list[str] = []
    typ3 = {"name": "typ3", "nuid": "T3", "size": 1, "chunks": 1, "options": "x", "metadata": [1]}
    info = parse_meta("h", msg("typ3", typ3), why.append)
    assert (info.name, info.size, info.link, info.chunk_size, info.attrs) == ("typ3", 1, None, 0, None)
    assert len(why) == 1 and "metadata [1] (not an object)" in why[0] and "options 'x' (not an object)" in why[0]
    why.clear()
    typ6 = {"name": "typ6", "nuid": "T6", "size": 0, "chunks": 0, "metadata": {"natsfs.symlink": 5}}
    info = parse_meta("h", msg("typ6", typ6), why.append)
    assert info.link is None and info.attrs is not None and info.attrs.symlink is None
    assert len(why) == 1 and "unusable natsfs.symlink 5" in why[0]


# Descriptive fields of the wrong JSON type, as other clients write them (nats.py stores whatever a user
# passes): that field or entry is ignored, the object shows as if it were absent, with one message per
# meta through `ignored`.
LENIENT_WRONG_TYPES: dict[str, tuple[dict, str]] = {
    "description-object": ({"description": {"x": 1}}, "description {'x': 1} (not a string)"),
    "description-number": ({"description": 5}, "description 5 (not a string)"),
    "headers-string": ({"headers": "garbage"}, "headers 'garbage' (not an object)"),
    "headers-list": ({"headers": ["H", "v"]}, "headers ['H', 'v'] (not an object)"),
    "headers-string-values": ({"headers": {"Content-Type": "text/plain"}},
                              "headers['Content-Type'] 'text/plain' (not a list of strings)"),
    "headers-number-items": ({"headers": {"H": [1]}}, "headers['H'] [1] (not a list of strings)"),
    "metadata-list": ({"metadata": [1]}, "metadata [1] (not an object)"),
    "metadata-string": ({"metadata": "garbage"}, "metadata 'garbage' (not an object)"),
    "metadata-number-value": ({"metadata": {"k": 5}}, "metadata['k'] 5 (not a string)"),
    "metadata-object-value": ({"metadata": {"k": {"a": "b"}}}, "metadata['k'] {'a': 'b'} (not a string)"),
    "options-string": ({"options": "x"}, "options 'x' (not an object)"),
    "options-list": ({"options": ["x"]}, "options ['x'] (not an object)"),
    "chunk-size-string": ({"options": {"max_chunk_size": "131072"}}, "options.max_chunk_size '131072'"),
    "chunk-size-negative": ({"options": {"max_chunk_size": -1}}, "options.max_chunk_size -1"),
    "chunk-size-over-uint32": ({"options": {"max_chunk_size": 2**32}}, "options.max_chunk_size 4294967296"),
    "chunk-size-float": ({"options": {"max_chunk_size": 1.5}}, "options.max_chunk_size 1.5"),
    "mtime-number": ({"mtime": 12}, "mtime 12 (not a string)"),
    "mtime-object": ({"mtime": {}}, "mtime {} (not a string)"),
}


@pytest.mark.parametrize("case", sorted(LENIENT_WRONG_TYPES))
def test_a_descriptive_field_of_the_wrong_json_type_is_ignored(case):
    fields, reported = LENIENT_WRONG_TYPES[case]
    doc = {"name": "x", "bucket": "b", "nuid": "abc", "size": 1, "chunks": 1, "mtime": "0001-01-01T00:00:00Z",
           "digest": HELLO_DIGEST} | fields
    why: list[str] = []
    info = parse_meta("b", msg("x", doc), why.append)
    assert (info.name, info.nuid, info.size, info.chunks, info.digest) == ("x", "abc", 1, 1, HELLO_DIGEST)
    assert info.chunk_size == 0 and info.link is None and info.attrs is None and not info.deleted
    assert len(why) == 1 and "meta for 'x' has fields of the wrong JSON type (ignored)" in why[0], why
    assert reported in why[0], why
    # A rewrite starts from the meta without what was ignored: one nats.go can read.
    usable = usable_fields(doc)
    assert usable == {k: v for k, v in doc.items() if k not in fields} | {
        k: {e: v for e, v in value.items() if e not in ("Content-Type", "H", "k", "max_chunk_size")}
        for k, value in fields.items() if isinstance(value, dict) and k in ("headers", "metadata", "options")}
    why.clear()
    parse_meta("b", msg("x", usable), why.append)
    assert why == []


def test_only_the_entries_of_the_wrong_type_are_ignored():
    """A map keeps its entries of the right type; the rest of the options (a link) stays."""
    doc = {"name": "x", "nuid": "abc", "size": 1, "chunks": 1,
           "headers": {"Content-Type": "text/plain", "Good": ["a", None], "Null": None, "Bad": [1, "b"]},
           "metadata": {"k": 5, "ok": "fine", "none": None, "natsfs.mode": 644, "natsfs.uid": "7"},
           "options": {"link": {"bucket": "b", "name": "t"}, "max_chunk_size": "big"}}
    why: list[str] = []
    info = parse_meta("b", msg("x", doc), why.append)
    assert info.link == Link("b", "t") and info.chunk_size == 0
    assert info.attrs is not None and info.attrs.uid == 7 and info.attrs.mode is None
    assert len(why) == 2, why
    assert "headers['Content-Type']" in why[0] and "headers['Bad']" in why[0] and "metadata['k']" in why[0]
    assert "options.max_chunk_size 'big'" in why[0] and "natsfs.mode" not in why[0]
    assert "unusable natsfs.mode 644" in why[1]
    usable = usable_fields(doc)
    assert usable["headers"] == {"Good": ["a", None], "Null": None}
    assert usable["metadata"] == {"ok": "fine", "none": None, "natsfs.uid": "7"}
    assert usable["options"] == {"link": {"bucket": "b", "name": "t"}}
    assert doc["headers"]["Content-Type"] == "text/plain"  # (the document read is left as it is)
    assert usable_fields(usable) is usable


def test_xattrs_never_turn_an_entry_of_the_wrong_type_into_text():
    """Even on a meta read as written (not through `usable_fields`), a metadata value or a header entry
    of the wrong type is no attribute; null ones read as empty, as nats.go reads them."""
    doc = {"name": "x", "metadata": {"k": 5, "o": {"a": 1}, "ok": "v", "none": None},
           "headers": {"Content-Type": "text/plain", "N": [1], "Good": ["a", None], "Null": None}}
    assert xattrs.list_object(doc, 1) == [b"user.none", b"user.ok", b"user.nats.header.Good",
                                          b"user.nats.header.Null"]
    for name in ("user.k", "user.o", "user.nats.header.Content-Type", "user.nats.header.N"):
        with pytest.raises(xattrs.NoAttribute):
            xattrs.get_object(doc, 1, name)
    assert xattrs.get_object(doc, 1, "user.ok") == b"v"
    assert xattrs.get_object(doc, 1, "user.nats.header.Good") == b"a\n"


def test_a_meta_with_many_entries_of_the_wrong_type_makes_one_short_message():
    doc = {"name": "x", "nuid": "abc", "size": 1, "chunks": 1, "headers": {f"H{i}": str(i) for i in range(1000)}}
    why: list[str] = []
    parse_meta("b", msg("x", doc), why.append)
    assert len(why) == 1 and "and 995 more" in why[0] and len(why[0]) < 1000


def test_values_of_the_right_type_that_natsfs_cannot_use_are_ignored():
    """nats.go reads these: the object shows, the value is ignored (one message through `ignored`)."""
    why: list[str] = []
    doc = {"name": "x", "nuid": "abc", "size": 1, "chunks": 1, "mtime": "garbage", "unknown": [1, {"a": 2}],
           "metadata": {"natsfs.mode": "notanint", "natsfs.uid": "-1", "natsfs.type": "block",
                        "natsfs.rdev": "99999999999999999999"}}
    info = parse_meta("b", msg("x", doc), why.append)
    assert info.size == 1 and info.attrs is not None and info.attrs.mode is None and info.attrs.uid is None
    assert len(why) == 3 and "natsfs.mode 'notanint'" in why[0] and "natsfs.rdev" in why[2]


def test_natsfs_attributes_in_metadata():
    doc = {"name": "x", "nuid": "abc", "size": 1, "chunks": 1,
           "metadata": {"natsfs.mode": "640", "natsfs.uid": "1000", "natsfs.gid": "bad", "natsfs.mtime_ns": "42",
                        "other": "kept out"}}
    info = parse_meta("b", msg("x", doc))
    assert info.attrs is not None
    assert (info.attrs.mode, info.attrs.uid, info.attrs.gid, info.attrs.mtime_ns) == (0o640, 1000, None, 42)
    assert info.mtime_ns == 42


def test_negative_natsfs_attributes_are_ignored():
    doc = {"name": "x", "nuid": "abc", "size": 1, "chunks": 1, "metadata": {"natsfs.uid": "-1"}}
    info = parse_meta("b", msg("x", doc))
    assert info.attrs is not None and info.attrs.uid is None
    assert info.mtime_ns == TS


@pytest.mark.parametrize(("raw", "shown"), [("-14182940000000000", -14182940000000000), ("-1", -1), ("0", 0),
                                            (str(-(2**63)), -(2**63)), (str(2**63 - 1), 2**63 - 1)])
def test_a_time_before_1970_is_a_negative_mtime_ns_and_kept(raw, shown):
    """`touch -d 1969-07-20` stores negative nanoseconds (as the kernel's times): a usable time, down to
    the int64 end, not an "unusable" value replaced by the meta's timestamp."""
    why: list[str] = []
    doc = {"name": "x", "nuid": "abc", "size": 1, "chunks": 1, "metadata": {"natsfs.mtime_ns": raw}}
    info = parse_meta("b", msg("x", doc), why.append)
    assert info.attrs is not None and info.attrs.mtime_ns == shown and info.mtime_ns == shown
    assert why == []


@pytest.mark.parametrize("raw", ["--1", "-", "- 1", "-0x10", "1e9", str(-(2**63) - 1), str(2**63)])
def test_an_mtime_ns_that_is_no_int64_number_is_still_ignored(raw):
    why: list[str] = []
    doc = {"name": "x", "nuid": "abc", "size": 1, "chunks": 1, "metadata": {"natsfs.mtime_ns": raw}}
    info = parse_meta("b", msg("x", doc), why.append)
    assert info.attrs is not None and info.attrs.mtime_ns is None and info.mtime_ns == TS
    assert len(why) == 1 and "natsfs.mtime_ns" in why[0]


@pytest.mark.parametrize(("key", "raw"), [
    ("natsfs.mode", "0o777"), ("natsfs.mode", " 755"), ("natsfs.mode", "755\n"), ("natsfs.mode", "7_5_5"),
    ("natsfs.mode", "+755"), ("natsfs.mode", "\u0667\u0665\u0665"), ("natsfs.mode", "8"), ("natsfs.uid", "+0"),
    ("natsfs.uid", "\u0661\u0662"), ("natsfs.gid", "1_000"), ("natsfs.rdev", " 1"),
    ("natsfs.mtime_ns", "1_000_000_000"), ("natsfs.mtime_ns", "+1"), ("natsfs.mtime_ns", " -1"),
])
def test_a_posix_attribute_that_is_not_a_string_of_ascii_digits_is_ignored(key, raw):
    """int() alone took these (an octal mode "0o777" showed as 0777, Arabic-Indic digits as a uid), where
    SEMANTICS ignores every value that is not a string of digits (with one warning, fsck reports it)."""
    why: list[str] = []
    doc = {"name": "x", "nuid": "abc", "size": 1, "chunks": 1, "metadata": {key: raw}}
    info = parse_meta("b", msg("x", doc), why.append)
    assert info.attrs is not None
    assert (info.attrs.mode, info.attrs.uid, info.attrs.gid, info.attrs.rdev, info.attrs.mtime_ns) == (None,) * 5
    assert len(why) == 1 and f"unusable {key}" in why[0]


@pytest.mark.parametrize("value", [420, None, ["644"]])
def test_non_string_natsfs_metadata_never_escapes_as_typeerror(value):
    doc = {"name": "x", "nuid": "abc", "size": 1, "chunks": 1, "metadata": {"natsfs.mode": value}}
    try:
        info = parse_meta("b", msg("x", doc))
    except MalformedMeta:
        return
    assert info.attrs is None or info.attrs.mode is None


def test_deeply_nested_json_is_malformed():
    with pytest.raises(MalformedMeta):
        parse_meta("b", msg("deep", b"[" * 100_000 + b"]" * 100_000))


# ---------------------------------------------------------------- names on subjects
@pytest.mark.parametrize("name", ["go/hello.txt", "ünïcödé.txt", "a", "ab", "abc", "../escape.txt", "x" * 300,
                                  "new\nline.txt", "", "?>*.", "\x00"])
def test_encode_decode_roundtrip(name):
    token = encode_name(name)
    assert "." not in token and "*" not in token and ">" not in token and " " not in token
    assert decode_token(token) == name
    assert decode_token(token.rstrip("=")) == name


def test_encode_name_is_padded_urlsafe_base64():
    assert encode_name("go/hello.txt") == "Z28vaGVsbG8udHh0"
    assert encode_name("go/renamed.txt") == "Z28vcmVuYW1lZC50eHQ="
    assert encode_name("js/small-chunks.bin") == "anMvc21hbGwtY2h1bmtzLmJpbg=="
    assert encode_name("\xff\xfe\xfd") == base64.urlsafe_b64encode("\xff\xfe\xfd".encode()).decode()
    assert "+" not in encode_name("\xfb\xff") and "/" not in encode_name("\xfb\xff")
    assert meta_subject("interop", ".") == "$O.interop.M.Lg=="


@pytest.mark.parametrize("token", ["/w==", "gA==", "é", "!!!notbase64"])
def test_decode_token_rejects_non_base64_or_non_utf8(token):
    assert decode_token(token) is None


@pytest.mark.parametrize("token", ["!!!", "Z28vaGVsbG8udHh0!", "Z28v!aGVsbG8udHh0"])
def test_decode_token_rejects_characters_outside_the_alphabet(token):
    assert decode_token(token) is None


# ---------------------------------------------------------------- digests
def test_digest_of_and_parse_digest():
    raw = hashlib.sha256(b"hello, world!\n").digest()
    d = digest_of(b"hello, world!\n")
    assert d.startswith("SHA-256=") and d.endswith("=")
    assert parse_digest(d) == raw
    assert format_digest(raw) == d
    assert parse_digest("sha-256=" + d[len("SHA-256="):]) == raw
    assert parse_digest(d.rstrip("=")) == raw
    assert parse_digest(digest_of(b"")) == hashlib.sha256(b"").digest()


@pytest.mark.parametrize("bad", ["", "SHA-256=", "SHA-1=" + base64.urlsafe_b64encode(b"x" * 20).decode(),
                                 "SHA-256=" + base64.urlsafe_b64encode(b"x" * 31).decode(), "SHA-256=!!!!",
                                 "no-equals-sign", "MD5=abc"])
def test_parse_digest_rejects(bad):
    assert parse_digest(bad) is None


@pytest.mark.parametrize(("name", "ok"), [("interop", True), ("a_b-c9", True), ("", False), ("a.b", False),
                                          ("a b", False), ("a*", False), ("ü", False)])
def test_valid_bucket_name(name, ok):
    assert valid_bucket_name(name) is ok


def test_stream_limits_from_a_config_keep_only_what_can_cut_a_version():
    from natsfs.adr20 import NO_LIMITS, StreamLimits

    # nats.go's object store config (discard new, no per-subject limit): nothing to check.
    assert StreamLimits.of({"discard": "new", "max_bytes": 1000, "max_msgs": 5, "max_msgs_per_subject": -1,
                            "max_age": 0}) == NO_LIMITS
    # Discard old is the server's default: max_bytes and max_msgs count then; odd values are no limit.
    limits = StreamLimits.of({"max_bytes": 400_000, "max_msgs": True, "max_msgs_per_subject": "1", "max_age": None})
    assert limits == StreamLimits(max_bytes=400_000) and limits.may_evict
    assert not StreamLimits(per_subject=1).may_evict  # (refused up front: nobody else writes a put's subject)
    assert StreamLimits(max_age_ns=10**9).may_evict and StreamLimits(max_age_ns=10**9).refusal(999, 1 << 40) is None
    assert "max_msgs_per_subject is 2" in (StreamLimits(per_subject=2).refusal(3, 0) or "")
    assert StreamLimits(per_subject=3).refusal(3, 0) is None
    assert StreamLimits(max_bytes=100).refusal(1, 101) and StreamLimits(max_bytes=100).refusal(1, 100) is None
    assert StreamLimits(max_msgs=4).refusal(4, 0) and StreamLimits(max_msgs=4).refusal(3, 0) is None


NATS_GO = {"subjects": ["$O.b.C.>", "$O.b.M.>"], "allow_rollup_hdrs": True}


@pytest.mark.parametrize(("config", "hidden", "read_only"), [
    (NATS_GO, False, ""),
    ({"subjects": ["$O.b.>"], "allow_rollup_hdrs": True}, False, ""),  # wider subjects take them too
    ({"subjects": ["$O.b.C.>", "$O.b.M.>", "x.>"], "allow_rollup_hdrs": True}, False, ""),
    (NATS_GO | {"sealed": True}, False, "sealed"),
    ({"subjects": ["$O.b.C.>", "$O.b.M.>"]}, False, "allow_rollup_hdrs"),
    ({"subjects": ["$O.b.C.>", "$O.b.M.>"], "deny_purge": True}, False, "deny_purge"),
    ({"mirror": {"name": "OBJ_a"}, "allow_rollup_hdrs": True}, False, "a mirror of stream OBJ_a"),
    ({"sources": [{"name": "OBJ_a"}], "allow_rollup_hdrs": True}, False, "sourced from OBJ_a"),
    (NATS_GO | {"sources": [{"name": "OBJ_a"}]}, False, ""),  # takes publishes of its own
    ({"subjects": ["foo.>"]}, True, None),
    ({"subjects": ["$O.b.M.>"], "allow_rollup_hdrs": True}, True, None),  # no chunk can be stored
    ({"subjects": ["$O.c.C.>", "$O.c.M.>"], "allow_rollup_hdrs": True}, True, None),  # another bucket's
    ({"subjects": ["$O.b.C.x", "$O.b.M.>"], "allow_rollup_hdrs": True}, True, None),
    ({"subjects": ["$O.*.C.*", "$O.b.M.>"], "allow_rollup_hdrs": True}, True, None),
])
def test_which_streams_are_object_stores_and_which_take_writes(config, hidden, read_only):
    from natsfs.adr20 import not_an_object_store, refuses_writes

    assert bool(not_an_object_store("b", config)) == hidden
    if read_only is not None:
        why = refuses_writes("b", config)
        assert (read_only in why) if read_only else why == ""


@pytest.mark.parametrize("nuid", ["*", ">", "x.*", "a.>"])
def test_a_wildcard_nuid_names_no_chunks_of_a_live_object_either(nuid):
    """Another client's live meta or link whose nuid holds a wildcard token: read as an object without
    chunks of its own (nuid ""), the nuid kept as `wildcard_nuid` for the mount's rewrite."""
    for fields in ({"size": 0, "chunks": 0}, {"size": 5, "chunks": 1},
                   {"size": 0, "chunks": 0, "options": {"link": {"bucket": "b", "name": "t"}}},
                   {"size": 0, "chunks": 0, "deleted": True}):
        info = parse_meta("b", msg("x", {"name": "x", "bucket": "b", "nuid": nuid} | fields))
        assert (info.nuid, info.wildcard_nuid, info.size) == ("", nuid, 0 if fields.get("deleted") else fields["size"])
    for bad in ({"nuid": nuid, "size": 5, "chunks": 0}, {"nuid": "a.b", "size": 0, "chunks": 0}):
        with pytest.raises(MalformedMeta):
            parse_meta("b", msg("x", {"name": "x", "bucket": "b"} | bad))


@pytest.mark.parametrize("data, expected", [
    (b"not json", None),
    (b"\xef\xbb\xbf{}", None),
    (b'{"name": "odd", "bucket": "b", "nuid": "*", "size": 5, "chunks": 0}', ("odd", "*")),
    (b'{"name": "odd", "nuid": "abc", "NUID": "x.>", "size": 5}', ("odd", "x.>")),
    (b'{"name": "odd", "nuid": "abc", "size": 5}', None),
    (b'{"name": "odd", "nuid": "*", "size": "5"}', None),  # (nats.go cannot read it: no Delete by it)
    (b'{"name": "other", "nuid": "*"}', None),  # (on another name's subject: an alias, read by no name)
    (b"[" * 20000 + b"]" * 20000, None),
])
def test_a_skipped_meta_is_rewritten_only_when_nats_go_reads_a_wildcard_nuid_on_its_own_subject(data, expected):
    msg = StoredMsg(7, meta_subject("b", "odd"), {"Nats-Rollup": "sub"}, data, TS)
    assert skipped_wildcard_nuid("b", msg) == expected
