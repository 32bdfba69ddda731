"""`_TrioReads.check_answering` (natsfs/bridge.py): the verdict "the server has not answered" (a read fails at
once with `NoConnection`, not asked again) is given only about the connection a request would go to."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from natsfs.bridge import _TrioReads
from natsfs.errors import NoConnection


class Silent:
    """A connection to a server that has sent nothing for `silent` seconds while a request waits, and
    answers no PING; `ended` (if given) runs part way through the wait for an answer."""

    def __init__(self, reads: _TrioReads, silent: float, ended=None) -> None:
        self.reads, self.silent, self.ended, self.is_closed = reads, silent, ended, False

    def silent_for(self) -> float:
        return self.silent

    async def answers(self, timeout: float) -> bool:
        with trio.move_on_after(timeout):
            await trio.sleep(timeout / 4)
            if self.ended is not None:
                self.ended(self)
            await trio.sleep(timeout)
        return False


def reads_over(silent: float, ended=None) -> _TrioReads:
    reads = _TrioReads.__new__(_TrioReads)
    reads.nc = Silent(reads, silent, ended)  # type: ignore[assignment]
    return reads


def test_a_silent_server_that_answers_no_ping_is_the_verdict():
    async def main() -> None:
        with pytest.raises(NoConnection):
            await reads_over(10.0).check_answering(2.0)
        await reads_over(1.0).check_answering(2.0)  # (not silent for a whole request timeout)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.parametrize("how", ["closed", "replaced"])
def test_no_verdict_on_a_connection_that_ended_while_its_server_was_asked(how):
    """The silent connection ends while the PING waits for its answer (the keepalive gave up on it, the
    server was killed): the request goes its usual way (it waits for the next connection, maybe to another
    server), not failed for the old connection's silence."""
    def ended(conn: Silent) -> None:
        conn.is_closed = True
        conn.reads.nc = None if how == "closed" else Silent(conn.reads, 0.0)  # type: ignore[assignment]

    async def main() -> None:
        await reads_over(10.0, ended).check_answering(2.0)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
