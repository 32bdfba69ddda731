"""errors.single_error: the one place exception groups from trio nurseries are unwrapped."""

from __future__ import annotations

from natsfs.errors import NoSpace, NotFound, single_error


def test_a_plain_exception_is_itself():
    e = ValueError("x")
    assert single_error(e) is e


def test_the_domain_error_inside_nested_groups_wins_over_its_siblings():
    domain = NoSpace("bucket full")
    group = ExceptionGroup("outer", [RuntimeError("sibling"), ExceptionGroup("inner", [KeyError("k"), domain])])
    assert single_error(group) is domain


def test_the_first_domain_error_is_chosen():
    first, second = NotFound("a"), NoSpace("b")
    assert single_error(ExceptionGroup("g", [first, second])) is first


def test_a_chain_of_single_member_groups_yields_its_one_exception():
    inner = KeyboardInterrupt()
    assert single_error(BaseExceptionGroup("a", [BaseExceptionGroup("b", [inner])])) is inner


def test_a_group_of_several_foreign_errors_stays_the_group():
    group = ExceptionGroup("g", [RuntimeError("1"), ValueError("2")])
    assert single_error(group) is group
