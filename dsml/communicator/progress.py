"""The progress log: a collective that waits long on its peers says for whom (communicator).

A call still running `first_s` after it started asks the peers where they are (a `Probe`
with `keep`: unlike the timeout's probe, the peers keep the call) and, once every peer
asked has answered (or after `answer_s`), logs one warning naming the ranks it still waits
for and where each was last seen (`diagnose.still_waiting_message`, from the call's
`WaitingFor`); then again when the call is twice as old, four times, ..., until it ends or
times out.

Cost: the first look of every call is kept by one shared `Deadlines` timer; only a call
that runs that long gets timers of its own, cancelled when it ends. A call made while an
older one of the same communicator is still in flight stays quiet at its turn: the older
call's line names the cause.
"""

from __future__ import annotations

import asyncio
import logging

from .call import Call
from .call_table import CallTable
from .deadlines import Deadlines
from .diagnose import still_waiting_message
from .waiting import WaitingFor

__all__ = ["ProgressLog"]

log = logging.getLogger("dsml.communicator")


class _Watch:
    """A call that ran long: when it looks next, and the question it waits answers to."""

    __slots__ = ("call", "next_age", "timer", "waiting")

    def __init__(self, call: Call, first_s: float) -> None:
        self.call = call
        self.next_age = first_s  # the call's age (seconds) at its next look
        self.timer: asyncio.TimerHandle | None = None
        self.waiting: WaitingFor | None = None  # asked, not reported yet


class ProgressLog:
    """Watches the collectives of one call table; see the module docstring.

    `first_s` None or 0 turns the log off.
    """

    def __init__(
        self,
        table: CallTable,
        loop: asyncio.AbstractEventLoop,
        first_s: float | None,
        answer_s: float,
    ) -> None:
        self._table = table
        self._loop = loop
        self._answer_s = answer_s
        self._first = Deadlines(loop, first_s, self._look_first) if first_s else None
        self._watches: dict[Call, _Watch] = {}

    def add(self, call: Call) -> None:
        """Watch a call that has just started (its `record` set)."""
        if self._first is not None:
            self._first.add(call)

    def end(self, call: Call) -> None:
        """The call ended: stop watching it."""
        if self._first is not None:
            self._first.forget_over()
        watch = self._watches.pop(call, None)
        if watch is not None and watch.timer is not None:
            watch.timer.cancel()

    def close(self) -> None:
        if self._first is not None:
            self._first.close()
        for watch in self._watches.values():
            if watch.timer is not None:
                watch.timer.cancel()
        self._watches.clear()

    def _look_first(self, call: Call) -> None:
        assert self._first is not None
        watch = self._watches[call] = _Watch(call, self._first.timeout)
        self._look(watch)

    def _look(self, watch: _Watch) -> None:
        """Ask every peer where it is; report when all have answered (or the wait ends)."""
        watch.timer = None
        call, record = watch.call, watch.call.record
        if call.over or call.failure is not None or record is None:
            return  # failing: its error (the timeout's probe among them) says why
        if self._behind_older(call):
            self._look_later(watch)
            return
        table = self._table
        waiting = WaitingFor(call.cid, [p for p in range(table.size) if p != table.rank])
        record.waiting_for = waiting
        watch.waiting = waiting
        if not waiting.silent():
            self._report(watch, waiting)
            return
        waiting.answered = self._loop.create_future()
        waiting.answered.add_done_callback(lambda _f: self._report(watch, waiting))
        table.ask_where(call, waiting)
        watch.timer = self._loop.call_later(self._answer_s, self._report, watch, waiting)

    def _report(self, watch: _Watch, waiting: WaitingFor) -> None:
        """Log the line of one look (once: the last answer and the wait's end both come)."""
        call, record = watch.call, watch.call.record
        if watch.waiting is not waiting or call.over or call.failure is not None:
            return
        assert record is not None
        watch.waiting = None
        if watch.timer is not None:
            watch.timer.cancel()
        message = still_waiting_message(call.fingerprint.collective, record.total_s, waiting)
        level = logging.WARNING if waiting.missing() else logging.INFO
        log.log(level, message, extra={"rank": self._table.rank, "epoch": call.epoch})
        self._look_later(watch)

    def _look_later(self, watch: _Watch) -> None:
        """Look again when the call is twice as old as at this look was due (or four
        times, ..., where the loop ran late: the next look is always in the future)."""
        record = watch.call.record
        assert record is not None
        age = record.total_s
        watch.next_age *= 2
        while watch.next_age <= age:
            watch.next_age *= 2
        watch.timer = self._loop.call_later(watch.next_age - age, self._look, watch)

    def _behind_older(self, call: Call) -> bool:
        """Whether an older collective of this table is still in flight."""
        return any(
            c.epoch == call.epoch and c.cid < call.cid and not c.over
            for c in self._table.calls.values()
        )

    def __repr__(self) -> str:
        state = "off" if self._first is None else f"first after {self._first.timeout:g} s"
        return f"<ProgressLog {state}, {len(self._watches)} calls running long>"
