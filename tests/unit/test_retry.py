"""natsfs.retry.Backoff: the one retry policy."""

from __future__ import annotations

from natsfs.retry import Backoff


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
