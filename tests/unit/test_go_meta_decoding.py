"""adr20.load_meta: a meta read as nats.go's encoding/json reads it into its ObjectInfo (keys folded, the
last one wins, null, merged objects, UTF-8, numbers), so natsfs shows the object nats.go shows."""

from __future__ import annotations

import builtins
import json
from typing import Any

import pytest

from natsfs import adr20
from natsfs.adr20 import MetaNotJSON, load_meta, meta_json, meta_subject, parse_meta, usable_fields
from natsfs.errors import MalformedMeta
from natsfs.streams import StoredMsg


def raw(*members: tuple[str, Any], extra: str = "") -> bytes:
    """A JSON object with exactly these members, in this order (duplicates kept)."""
    body = ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in members)
    return ("{" + body + extra + "}").encode()


UNREADABLE = r"not one nats\.go can read"
BASE = (("name", "x"), ("bucket", "b"), ("size", 0), ("chunks", 0), ("mtime", "0001-01-01T00:00:00Z"))


def parse(data: bytes, name: str = "x"):
    return parse_meta("b", StoredMsg(3, meta_subject("b", name), {}, data, 1_700_000_000_000_000_000))


# ---------------------------------------------------------------- keys: folded, the last one wins
@pytest.mark.parametrize("key", ["NUID", "Nuid", "nUiD"])
def test_a_case_variant_after_the_key_is_what_nats_go_reads(key):
    info = parse(raw(*BASE, ("nuid", "abc"), (key, "*")))
    assert (info.nuid, info.wildcard_nuid) == ("", "*")


def test_the_last_key_wins_also_when_it_is_the_canonical_one():
    assert parse(raw(*BASE, ("NUID", "*"), ("nuid", "abc"))).nuid == "abc"


@pytest.mark.parametrize("key", ["Name", "NAME"])
def test_name_variants(key):
    info = parse(raw(*BASE, ("nuid", "abc"), (key, "other")), name="other")
    assert info.name == "other"
    with pytest.raises(MalformedMeta, match="subject another name"):
        parse(raw(*BASE, ("nuid", "abc"), (key, "other")), name="x")


def test_deleted_and_options_and_link_variants():
    info = parse(raw(*BASE, ("nuid", "abc"), ("Deleted", True)))
    assert info.deleted
    assert not parse(raw(*BASE, ("nuid", "abc"), ("deleted", True), ("DELETED", False))).deleted
    link = parse(raw(*BASE, ("nuid", "abc"), ("Options", {"Link": {"BUCKET": "o", "Name": "t"}}))).link
    assert link is not None and (link.bucket, link.name) == ("o", "t")


def test_go_special_folds_long_s_and_kelvin_but_not_dotless_i():
    # U+017F folds to s, U+212A (Kelvin) to k: `ſize` is `size`, `lin\u212a` is `link`.
    info = parse(raw(*BASE, ("nuid", "abc"), ("chunks", 1), ("\u017fize", 5)))
    assert info.size == 5
    link = parse(raw(*BASE, ("nuid", "abc"), ("options", {"lin\u212a": {"bucket": "o"}}))).link
    assert link is not None and link.bucket == "o"
    # U+0131 (dotless i) folds to nothing but itself in Go: an unknown key.
    assert parse(raw(*BASE, ("nuid", "abc"), ("nu\u0131d", "*"))).nuid == "abc"


def test_map_keys_are_not_folded():
    doc, _ = load_meta(raw(*BASE, ("metadata", {"natsfs.mode": "600", "NATSFS.MODE": "644"})))
    assert doc["metadata"] == {"natsfs.mode": "600", "NATSFS.MODE": "644"}
    assert parse(raw(*BASE, ("metadata", {"natsfs.mode": "600", "NATSFS.MODE": "644"}))).attrs.mode == 0o600


# ---------------------------------------------------------------- null and objects given twice
def test_null_leaves_a_string_number_or_boolean_as_it_was():
    info = parse(raw(*BASE, ("nuid", "*"), ("nuid", None)))
    assert info.wildcard_nuid == "*"
    assert parse(raw(*BASE, ("nuid", "abc"), ("deleted", True), ("deleted", None))).deleted
    assert parse(raw(*BASE, ("nuid", "abc"), ("chunks", 1), ("size", 9), ("size", None))).size == 9


def test_null_makes_an_object_absent_and_objects_given_twice_merge():
    link = {"link": {"bucket": "o", "name": "t"}}
    assert parse(raw(*BASE, ("nuid", "abc"), ("options", link), ("options", None))).link is None
    merged = parse(raw(*BASE, ("nuid", "abc"), ("options", link), ("Options", {"max_chunk_size": 4096})))
    assert merged.link is not None and merged.link.name == "t" and merged.chunk_size == 4096
    doc, _ = load_meta(raw(*BASE, ("headers", {"A": ["1"]}), ("Headers", {"B": ["2"]})))
    assert doc["headers"] == {"A": ["1"], "B": ["2"]}


# ---------------------------------------------------------------- types: any occurrence of the wrong one
@pytest.mark.parametrize("members", [
    (("size", "5"), ("size", 5)),  # an earlier value of the wrong type fails Go's decode
    (("nuid", 5), ("NUID", "abc")),
    (("deleted", "true"), ("deleted", False)),
    (("options", {"link": {"bucket": 7}}), ("options", {"link": {"bucket": "o"}})),
])
def test_a_wrong_type_in_any_occurrence_of_a_field_that_decides_the_object_is_malformed(members):
    with pytest.raises(MalformedMeta, match=UNREADABLE):
        parse(raw(*BASE, ("nuid", "abc"), ("chunks", 1), *members))


@pytest.mark.parametrize("number", ["-1", "-0", "1.5", "5.0", "1e2", str(2**64), "1" * 5000])
def test_a_size_go_cannot_read_as_uint64_is_malformed(number):
    data = raw(*BASE, ("nuid", "abc"), ("chunks", 1), extra=f',"size":{number}')
    with pytest.raises(MalformedMeta, match=UNREADABLE):
        parse(data)


@pytest.mark.parametrize("number", [str(2**32), "-1", "1" * 5000])
def test_chunks_go_cannot_read_as_uint32_is_malformed(number):
    with pytest.raises(MalformedMeta, match=UNREADABLE):
        parse(raw(*BASE, ("nuid", "abc"), extra=f',"chunks":{number}'))


@pytest.mark.parametrize("value", ["1" * 5000, "1e999", "-1e999", "[[1]]"])
def test_an_unknown_key_holds_anything_go_parses(value):
    info = parse(raw(*BASE, ("nuid", "abc"), extra=f',"other":{value}'))
    assert info.nuid == "abc"
    # A rewrite never writes what no JSON reader takes (Python's int() limit, Infinity).
    json.loads(meta_json(load_meta(raw(*BASE, extra=f',"other":{value}'))[0]))


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json(constant):
    with pytest.raises(MalformedMeta, match="is not JSON"):
        parse(raw(*BASE, ("nuid", "abc"), extra=f',"other":{constant}'))


# ---------------------------------------------------------------- bytes
def test_a_byte_order_mark_is_not_json_to_go():
    with pytest.raises(MalformedMeta, match="byte order mark"):
        parse(b"\xef\xbb\xbf" + raw(*BASE, ("nuid", "abc")))


def test_utf16_is_not_json_to_go():
    with pytest.raises(MalformedMeta, match="is not JSON"):
        parse(raw(*BASE, ("nuid", "abc")).decode().encode("utf-16"))


def test_invalid_utf8_in_a_string_is_one_replacement_character_per_byte():
    # Go's decoder coerces each invalid byte to U+FFFD (Python's decoder would refuse the whole meta).
    data = raw(*BASE, ("nuid", "abc")).replace(b'"name":"x"', b'"name":"a\xe2\x82b\xed\xa0\x80"')
    name = "a\ufffd\ufffdb\ufffd\ufffd\ufffd"
    assert parse(data, name=name).name == name
    described = raw(*BASE, ("nuid", "abc")).replace(b'"bucket"', b'"description":"\xff","bucket"')
    assert load_meta(described)[0]["description"] == "\ufffd" and parse(described).nuid == "abc"


def test_an_escaped_lone_surrogate_is_a_replacement_character():
    data = raw(*BASE, ("nuid", "abc")).replace(b'"name":"x"', b'"name":"\\ud800x\\udc00\\ud800"')
    name = "\ufffdx\ufffd\ufffd"
    assert parse(data, name=name).name == name
    assert parse(raw(*BASE, ("nuid", "abc")).replace(b'"x"', b'"\\ud83d\\ude00"'), name="\U0001f600")


# ---------------------------------------------------------------- nesting
@pytest.mark.parametrize("depth", [500, 950, 5000])
def test_nesting_deeper_than_python_parses_is_read_as_go_reads_it(depth):
    # (An escape has the strings walked too, and that walk recurses as well.)
    deep = "[" * depth + '"\\u0041"' + "]" * depth
    info = parse(raw(*BASE, ("nuid", "abc"), extra=f',"junk":{deep},"NUID":"*"'))
    assert info.wildcard_nuid == "*"
    doc = load_meta(raw(*BASE, extra=f',"junk":{deep}'))[0]
    json.loads(meta_json(doc))


def test_nesting_deeper_than_go_takes_is_not_json():
    with pytest.raises(MetaNotJSON, match="10000"):
        load_meta(raw(*BASE, extra=f',"junk":{"[" * 10001 + "]" * 10001}'))
    load_meta(raw(*BASE, extra=f',"junk":{"[" * 9999 + "]" * 9999}'))


def test_brackets_in_strings_do_not_count_as_nesting():
    deep = "[" * 3000 + json.dumps("]]]}}}[[[{{{") + "]" * 3000
    doc, wrong = load_meta(raw(*BASE, ("nuid", "abc"), extra=f',"junk":{deep}'))
    assert doc["nuid"] == "abc" and wrong is None


# ---------------------------------------------------------------- rewrites
def test_a_rewritten_meta_holds_canonical_keys_only():
    doc, _ = load_meta(raw(*BASE, ("nuid", "abc"), ("Description", "d"), ("NUID", "xyz"), ("Deleted", False),
                           ("options", {"LINK": {"Bucket": "o"}, "Max_Chunk_Size": 4096}), ("other", 1)))
    written = json.loads(meta_json(doc))
    assert written == {"name": "x", "description": "d", "options": {"link": {"bucket": "o"}, "max_chunk_size": 4096},
                       "bucket": "b", "nuid": "xyz", "size": 0, "mtime": "0001-01-01T00:00:00Z", "chunks": 0,
                       "other": 1}
    # meta_json itself drops a variant a caller's doc may carry: it would make nats.go read another value.
    assert json.loads(meta_json({"name": "x", "nuid": "abc", "NUID": "*", "options": {"Link": {"bucket": "o"}}})) \
        == {"name": "x", "nuid": "abc"}


# ---------------------------------------------------------------- found by tests/unit/test_meta_decoding_fuzz.py
@pytest.mark.parametrize("levels", [998, 1000, 5000, 9998])
@pytest.mark.parametrize("junk", ["nope", "[1,]", "NaN", "01", "1 2", '"\\x"', '"open', "[}"])
def test_no_json_nested_deeper_than_python_parses_is_not_json(levels, junk):
    # The value cut out at 64 levels was never parsed: a meta Go refuses as a whole (nats.go never lists
    # it) showed as an object, and its wildcard nuid was rewritten by the mount.
    deep = "[" * levels + junk + "]" * levels
    data = raw(*BASE, ("nuid", "abc"), extra=f',"junk":{deep},"NUID":"*"')
    with pytest.raises(MetaNotJSON, match="is not JSON"):
        load_meta(data)
    with pytest.raises(MalformedMeta, match="is not JSON"):
        parse(data)
    fine = "[" * levels + '[1,"]}x"]' + "]" * levels
    assert parse(raw(*BASE, ("nuid", "abc"), extra=f',"junk":{fine},"NUID":"*"')).wildcard_nuid == "*"


@pytest.mark.parametrize("junk", ["[" * 2000, "[" * 2000 + "]" * 1999, "[" * 2000 + "]" * 2001,
                                  "[" * 1000 + '"' + "]" * 1000, "[" * 1000 + '"\\\n"' + "]" * 1000])
def test_brackets_left_open_or_closed_too_often_deep_down_are_not_json(junk):
    with pytest.raises(MalformedMeta, match="is not JSON"):
        parse(raw(*BASE, ("nuid", "abc"), extra=f',"junk":{junk}'))


class _CountedKey(str):
    """A key that counts how often it is compared (a list scanned for it compares it with each entry)."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        _CountedKey.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_thousands_of_header_entries_of_the_wrong_type_cost_linear_work():
    # Each entry was looked up in the list of the bad ones: 11 s for a 1 MiB meta.
    n = 3000
    headers = {_CountedKey(f"k{i}"): 1 for i in range(n)} | {"ok": ["1"]}
    _CountedKey.compared = 0
    assert usable_fields({"name": "x", "headers": headers})["headers"] == {"ok": ["1"]}
    assert _CountedKey.compared < n


def test_a_field_given_thousands_of_times_is_merged_with_linear_work(monkeypatch):
    # Each repeat of `options`, `link`, `headers` or `metadata` copied all the ones before had set (Go
    # decodes into the one it holds): 4 to 12 s for a 1 MiB meta. Counted: the entries adr20 copies.
    copied = [0]

    class CountingType(type):
        def __instancecheck__(cls, obj: object) -> bool:
            return isinstance(obj, builtins.dict)

    class CountingDict(builtins.dict, metaclass=CountingType):  # type: ignore[type-arg]
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            copied[0] += sum(len(a) for a in args if hasattr(a, "__len__"))
            return builtins.dict(*args, **kwargs)

    n = 2000
    big = ",".join(f'"k{i}":["1"]' for i in range(n))
    for field, text in (("options", f'"options":{{{big}}}' + ',"Options":{}' * n),
                        ("link", f'"options":{{"link":{{"bucket":"o",{big}}}' + ',"LINK":{}' * n + "}"),
                        ("headers", f'"headers":{{{big}}}' + ',"Headers":{}' * n),
                        ("metadata", f'"metadata":{{{big}}}' + ',"METADATA":{}' * n)):
        data = raw(*BASE, extra="," + text)
        monkeypatch.setattr(adr20, "dict", CountingDict, raising=False)
        copied[0] = 0
        doc = load_meta(data)[0]
        monkeypatch.undo()
        assert copied[0] < 10 * n, field
        merged = doc["options"]["link"] if field == "link" else doc[field]
        assert "k0" in merged and f"k{n - 1}" in merged


def _deeper(frames: int, call: Any) -> Any:
    return call() if frames <= 0 else _deeper(frames - 1, call)


@pytest.mark.parametrize("levels", [65, 300, 480])
def test_what_a_deep_value_reads_as_does_not_depend_on_the_stack(levels):
    # It was kept as written where Python's parser and the walks after it had the stack for it, cut
    # elsewhere: a rewrite stored it whole, the next read of that rewrite (deeper in the stack, or with an
    # escape to walk) cut it, and the next rewrite stored another meta.
    data = raw(*BASE, ("nuid", "abc"), extra=',"junk":' + '{"a":' * levels + '"\\u003e"' + "}" * levels)
    doc = load_meta(data)[0]
    assert _deeper(400, lambda: load_meta(data)[0]) == doc
    assert meta_json(doc).count(b"{") == 64  # (the meta and 63 levels: the 64th, 65 deep, is [])
    rewritten = meta_json(doc)
    assert _deeper(400, lambda: meta_json(load_meta(rewritten)[0])) == rewritten
