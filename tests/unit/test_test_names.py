"""The suite's own layout: test modules are imported by basename (no packages under tests/), so two
files of one name in different tiers break the collection of the whole suite, while each tier run on
its own still passes."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def test_every_test_module_has_a_basename_of_its_own():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [name for name, n in names.items() if n > 1] == []
