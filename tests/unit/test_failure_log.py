"""fs.FailureLog: one line per distinct failure, repeats counted and summarised."""

from __future__ import annotations

import logging

import pytest

from natsfs.fs import FailureLog


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "natsfs.fs"]


@pytest.mark.expect_log("chunk 3 is larger than its chunk size")
def test_a_repeated_failure_is_logged_once_then_summarised(caplog):
    clock = Clock()
    failures = FailureLog(window=60, clock=clock)
    with caplog.at_level(logging.DEBUG, logger="natsfs.fs"):
        for _ in range(71):
            failures.log(logging.ERROR, "read: b/x: chunk 3 is larger than its chunk size")
        failures.log(logging.ERROR, "read: b/y: chunk 3 is larger than its chunk size")  # another object
        assert _lines(caplog) == ["read: b/x: chunk 3 is larger than its chunk size",
                                  "read: b/y: chunk 3 is larger than its chunk size"]
        clock.now += 61
        failures.log(logging.WARNING, "flush: something else")  # any later failure sweeps old counts
    assert _lines(caplog)[2:] == ["read: b/x: chunk 3 is larger than its chunk size (repeated 70 times in 60 s)",
                                  "flush: something else"]


@pytest.mark.expect_log("flush: b/x: timed out")
def test_the_next_occurrence_after_the_window_is_logged_after_the_count(caplog):
    clock = Clock()
    failures = FailureLog(window=60, clock=clock)
    with caplog.at_level(logging.DEBUG, logger="natsfs.fs"):
        failures.log(logging.ERROR, "flush: b/x: timed out")
        clock.now += 30
        failures.log(logging.ERROR, "flush: b/x: timed out")
        failures.log(logging.ERROR, "flush: b/x: timed out")
        clock.now += 31
        failures.log(logging.ERROR, "flush: b/x: timed out")
        clock.now += 1
        failures.log(logging.ERROR, "flush: b/x: timed out")
    assert _lines(caplog) == ["flush: b/x: timed out", "flush: b/x: timed out (repeated 2 times in 60 s)",
                              "flush: b/x: timed out"]


def test_debug_and_info_are_not_counted(caplog):
    failures = FailureLog(window=60, clock=Clock())
    with caplog.at_level(logging.DEBUG, logger="natsfs.fs"):
        for _ in range(3):
            failures.log(logging.DEBUG, "lookup: no such file")
    assert _lines(caplog) == ["lookup: no such file"] * 3
