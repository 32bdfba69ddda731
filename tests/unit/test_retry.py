"""natsfs.retry: Backoff (the one retry policy) and Restarts (when a dead helper child is started again)."""

from __future__ import annotations

import signal

from natsfs.retry import Backoff, Restarts, describe_exit


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
