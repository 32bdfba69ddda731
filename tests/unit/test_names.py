"""names.placement / escape: where every object name shows, and that no name escapes its bucket."""

from __future__ import annotations

import pytest

from natsfs.names import NAME_MAX, escape, is_marker_name, object_name, placement, segment_ok

# (object name, marker candidate, expected placement) for every name in the interop fixture README.
FIXTURE_NAMES = [
    ("go/hello.txt", False, (("go", "hello.txt"), False)),
    ("js/small-chunks.bin", False, (("js", "small-chunks.bin"), False)),
    ("../escape.txt", False, (("..%2Fescape.txt",), True)),
    ("/abs/path.txt", False, (("%2Fabs%2Fpath.txt",), True)),
    ("a//double.txt", False, (("a%2F%2Fdouble.txt",), True)),
    (".", False, (("%2E",), True)),
    ("..", False, (("%2E%2E",), True)),
    ("d/./e.txt", False, (("d%2F.%2Fe.txt",), True)),
    ("dir-marker/", False, (("dir-marker%2F",), True)),  # has content: not a marker
    ("clash", False, (("clash",), False)),
    ("clash/inner.txt", False, (("clash", "inner.txt"), False)),
    ("space name.txt", False, (("space name.txt",), False)),
    ("tab\tname.txt", False, (("tab\tname.txt",), False)),
    ("new\nline.txt", False, (("new\nline.txt",), False)),
    ("ünïcödé.txt", False, (("ünïcödé.txt",), False)),
    ("x" * 300, False, (None, False)),
    ("no-nuid", False, (("no-nuid",), False)),
    ("bad-json", False, (("bad-json",), False)),
]


@pytest.mark.parametrize(("name", "marker", "expected"), FIXTURE_NAMES, ids=[repr(n[0])[:40] for n in FIXTURE_NAMES])
def test_fixture_names_place_as_documented(name, marker, expected):
    assert placement(name, marker_candidate=marker) == expected


HOSTILE = ["../escape.txt", "/abs/path.txt", "a//double.txt", ".", "..", "d/./e.txt", "dir-marker/",
           "../../../etc/passwd", "a/../../b", "/", "//", "./", "../", "a/.", "a/..", "..%2F", "%2E", "\x00",
           "a\x00b/c", "x" * 300, "a/" + "y" * 300, "", "%", "%25/%2F"]


@pytest.mark.parametrize("name", HOSTILE, ids=[repr(n)[:40] for n in HOSTILE])
@pytest.mark.parametrize("marker", [False, True])
def test_no_name_escapes_the_bucket(name, marker):
    path, escaped = placement(name, marker_candidate=marker)
    if path is None:
        return
    assert path, "an object never takes the bucket directory itself"
    for seg in path:
        assert segment_ok(seg)
        assert seg not in (".", "..", "")
        assert "/" not in seg and "\x00" not in seg
        assert len(seg.encode("utf-8", "surrogatepass")) <= NAME_MAX
    if escaped:
        assert len(path) == 1
    else:
        assert object_name(path) == (name[:-1] if marker and name.endswith("/") else name)


def test_escape_rules():
    assert escape("a/b") == "a%2Fb"
    assert escape("100%") == "100%25"
    assert escape("%2F") == "%252F"
    assert escape(".") == "%2E"
    assert escape("..") == "%2E%2E"
    assert escape("...") == "..."
    assert escape("a\x00b") == "a%00b"


def test_escape_is_injective_on_hostile_names():
    names = [n for n in HOSTILE if n] + ["%2F", "%2E", "%00", "a%2Fb", "a/b", "a%b", "%"]
    names = list(dict.fromkeys(names))
    escaped = [escape(n) for n in names]
    assert len(set(escaped)) == len(escaped)


def test_markers_become_directories():
    assert is_marker_name("a/b/")
    assert not is_marker_name("a/b")
    assert placement("a/b/", marker_candidate=True) == (("a", "b"), False)
    assert placement("top/", marker_candidate=True) == (("top",), False)
    # Not a usable marker path: falls back to the escaped-file rule.
    assert placement("a//", marker_candidate=True) == (("a%2F%2F",), True)
    assert placement("/", marker_candidate=True) == (("%2F",), True)
    assert placement("./", marker_candidate=True) == ((".%2F",), True)


def test_segment_length_limit_counts_utf8_bytes():
    assert placement("a" * 255) == (("a" * 255,), False)
    assert placement("a" * 256) == (None, False)
    assert placement("é" * 127) == (("é" * 127,), False)  # 254 bytes
    assert placement("é" * 128) == (None, False)  # 256 bytes
    # Escaping grows the name: a legal-length segment with a bad neighbour can become too long.
    assert placement("a/" + "b" * 253) == (("a", "b" * 253), False)
    assert placement("/" + "b" * 253) == (None, False)
    assert placement("/" + "b" * 252) == (("%2F" + "b" * 252,), True)


def test_segment_ok():
    assert segment_ok("file")
    assert segment_ok("...")
    assert segment_ok(" ")
    for bad in ["", ".", "..", "a/b", "a\x00", "x" * 256]:
        assert not segment_ok(bad)
