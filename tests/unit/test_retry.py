"""natsfs.retry: Backoff (the one retry policy), Restarts (when a dead helper child is started again) and
Silence (when a helper child that answers nothing is hung)."""

from __future__ import annotations

import signal

from natsfs.retry import Backoff, Restarts, Silence, describe_exit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pauses_double_up_to_the_cap_and_count_failures():
    b = Backoff(0.2, 1.0, clock=Clock())
    assert [b.next_pause() for _ in range(5)] == [0.2, 0.4, 0.8, 1.0, 1.0]
    assert b.failures == 5 and not b.expired


def test_reset_starts_from_the_first_pause_again():
    b = Backoff(0.5, 5.0, clock=Clock())
    b.next_pause(), b.next_pause()
    b.reset()
    assert b.failures == 0 and b.next_pause() == 0.5


def test_a_pause_never_outlasts_the_timeout_and_then_it_has_expired():
    clock = Clock()
    b = Backoff(2.0, 8.0, timeout=3.0, clock=clock)
    assert b.next_pause() == 2.0
    clock.now += 2.0
    assert b.next_pause() == 1.0  # only one second left of three
    assert not b.expired
    clock.now += 1.0
    assert b.expired and b.next_pause() == 0.0


def test_a_child_that_ran_a_while_is_restarted_at_once_every_time():
    clock = Clock()
    r = Restarts(first=0.25, cap=60, stable=10, give_up_after=3, clock=clock)
    for _ in range(10):
        r.started()
        clock.now += 11  # killed after a stable run: not a failed restart
        assert r.died() == 0.25 and not r.newly_failing() and not r.failing and r.failures == 0


def test_a_child_that_dies_at_once_is_restarted_less_and_less_often_and_said_once():
    clock = Clock()
    r = Restarts(first=0.25, cap=2, stable=10, give_up_after=3, clock=clock)
    r.started()
    clock.now += 100
    pauses, said = [], []
    for _ in range(8):
        pauses.append(r.died())
        said.append(r.newly_failing())
        clock.now += pauses[-1]
        r.started()  # and it dies at once again
    assert pauses == [0.25, 0.5, 1.0, 2, 2, 2, 2, 2]  # never spins, never waits more than the cap
    assert said == [False, False, False, True, False, False, False, False] and r.failing
    # It runs long enough again: the next death is an ordinary one (said at WARNING by the caller).
    clock.now += 11
    assert r.died() == 0.25 and not r.failing and not r.newly_failing()


def test_a_child_that_cannot_be_started_counts_as_a_failed_restart():
    r = Restarts(first=1, cap=8, give_up_after=2, clock=Clock())
    r.started()
    assert r.died() == 1 and r.died() == 2 and r.died() == 4 and r.newly_failing()


def test_exits_are_described_for_the_log():
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(1) == "exit status 1" and describe_exit(None) == "still running"


def test_a_child_with_nothing_asked_is_never_hung_however_long_it_is_quiet():
    clock = Clock()
    s = Silence(5.0, clock=clock)
    clock.now += 1000
    assert not s.hung and s.silent_for == 0 and s.due() == float("inf")


def test_a_question_unanswered_for_the_limit_makes_the_child_hung():
    clock = Clock()
    s = Silence(5.0, clock=clock)
    s.asked()
    clock.now += 4.9
    assert not s.hung and abs(s.due() - 0.1) < 1e-9
    clock.now += 0.1
    assert s.hung and s.silent_for == 5.0 and s.due() == 0


def test_a_busy_child_that_keeps_answering_something_is_not_hung():
    """One long request (a large range) waits far longer than the limit; pings asked meanwhile are
    answered: progress, so the child is not hung. Once answers stop, it is, `limit` after the last one."""
    clock = Clock()
    s = Silence(5.0, clock=clock)
    s.asked()  # the long send
    for _ in range(30):
        clock.now += 1
        s.asked()  # a ping ...
        s.answered()  # ... answered at once
        assert not s.hung and s.waiting == 1
    s.asked()  # a ping the child never answers
    clock.now += 4.99
    assert not s.hung
    clock.now += 0.01
    assert s.hung


def test_each_answer_restarts_the_wait_of_what_is_still_out_and_the_last_one_ends_it():
    clock = Clock()
    s = Silence(5.0, clock=clock)
    s.asked(), s.asked()
    clock.now += 4
    s.answered()
    clock.now += 4
    assert not s.hung and s.silent_for == 4
    s.answered()
    clock.now += 100
    assert not s.hung and s.waiting == 0


def test_withdrawn_questions_are_not_waited_for():
    clock = Clock()
    s = Silence(5.0, clock=clock)
    s.asked()
    clock.now += 3
    s.withdrawn()  # (cancelled: no answer expected)
    clock.now += 10
    assert not s.hung
    s.asked()  # a new question is timed from now
    clock.now += 4
    assert not s.hung
