"""links.link_target: a link's symlink target never leaves the mount, whatever its meta says."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from natsfs.adr20 import Link
from natsfs.links import INVALID_TARGET, link_target


def lexically_inside(target: str, link_path: tuple[str, ...]) -> bool:
    """Whether `target`, followed from the directory of a link at `link_path`, stays in the mount."""
    if target.startswith("/"):
        return False
    depth = len(link_path) - 1
    for segment in target.split("/"):
        if segment == "..":
            depth -= 1
            if depth < 0:
                return False
        elif segment not in ("", "."):
            depth += 1
    return True


@pytest.mark.parametrize(("link", "link_path", "single", "expected"), [
    (Link("b", "dir/x"), ("a", "l"), None, "../b/dir/x"),
    (Link("b", "dir/x"), ("a", "d", "l"), None, "../../b/dir/x"),
    (Link("b", None), ("a", "l"), None, "../b"),
    (Link("b", "x"), ("l",), "b", "x"),
    (Link("b", None), ("l",), "b", "."),
    (Link("b", None), ("d", "l"), "b", "../"),
    (Link("b", "../x"), ("a", "l"), None, "../b/..%2Fx"),
    (Link("b", "/etc/passwd"), ("l",), "b", "%2Fetc%2Fpasswd"),
    (Link("o", "x/y"), ("l",), "b", "nats-object:o/x/y"),
    (Link("o", None), ("d", "l"), "b", "nats-object:o/"),
    (Link("../../etc", "passwd"), ("a", "l"), None, INVALID_TARGET),
    (Link("../../etc", "passwd"), ("l",), "b", INVALID_TARGET),
    (Link("..", None), ("a", "l"), None, INVALID_TARGET),
    (Link("/etc", "passwd"), ("a", "l"), None, INVALID_TARGET),
    (Link("", "x"), ("a", "l"), None, INVALID_TARGET),
    (Link("b", "n" * 300), ("a", "l"), None, INVALID_TARGET),
])
def test_targets(link, link_path, single, expected):
    target = link_target(link, link_path, single)
    assert target.text == expected
    assert (target.outside is None) == (not expected.startswith("nats-object:"))
    assert target.hostile == (expected == INVALID_TARGET)


segments = st.sampled_from(["a", "b", "..", ".", "", "/", "etc", "nats-object:..", "%2F", "\x00"])
texts = st.lists(segments, max_size=8).map("".join) | st.text(max_size=40)
link_paths = st.lists(st.sampled_from(["d", "e", "l"]), min_size=2, max_size=5).map(tuple)


@given(bucket=texts, name=st.none() | texts, link_path=link_paths, single=st.none() | st.sampled_from(["b", "a"]))
def test_no_link_target_leaves_the_mount(bucket, name, link_path, single):
    path = link_path[1:] if single is not None else link_path
    target = link_target(Link(bucket, name), path, single)
    assert lexically_inside(target.text, path), target
    if target.outside is not None:
        # Not inside: a dangling name in the link's own directory, never climbing out of it.
        assert target.text.startswith("nats-object:") and ".." not in target.text.split("/")
