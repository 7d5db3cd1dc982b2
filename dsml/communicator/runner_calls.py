"""A started call's task: its time, deadline, timeout report and end (communicator layer).

`CallRunner` runs a call once `Runner` (runner.py) has given it its collective id and its
plan: the task records where the call's time went (`comm.stats()`), arms its deadline
(the shared one in deadlines.py, or a timer of its own) and the progress log's watch
(progress.py), fails it at once when a failure is already known, turns `DeadlinePassed`
into a `CollectiveTimeoutError` after asking the peers where they are, and tells the
peers when this rank failed. When the task ends it leaves the call table; a call the user
cancelled is aborted at the peers a moment later, unless the communicator closes first.
Sends and receives run here too, with a deadline each. The runner owns it (one per
communicator) and calls it; its state (deadlines, progress log, pending aborts of
cancelled calls, whether it is closing) is its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ..config import CommConfig
from ..errors import CollectiveError, CollectiveTimeoutError, DsmlError, ProtocolError
from .call import Call, DeadlinePassed
from .call_table import CallTable
from .collective_handle import CollectiveHandle, Unclaimed
from .deadlines import Deadlines
from .diagnose import timeout_message
from .flight import FlightRecorder
from .plans import Plan
from .progress import ProgressLog
from .stats import CallStats, profiler_span
from .stats import current as current_record
from .tasks import TaskOwner
from .waiting import WaitingFor

__all__ = ["CallRunner"]

#: A call the user cancelled is aborted at the peers after this delay, unless the
#: communicator closes meanwhile (an interrupt cancels the call, then closes): its
#: goodbye then names the call as the first one this rank did not make, so every peer
#: fails that same call as a member leaving (MemberLeftError), not as an abort.
_CANCEL_ABORT_DELAY_S = 0.05

T = TypeVar("T")

log = logging.getLogger("dsml.communicator")


class CallRunner:
    """Runs started calls as their tasks, and ends them; see the module docstring."""

    def __init__(
        self,
        table: CallTable,
        tasks: TaskOwner,
        config: CommConfig,
        loop: asyncio.AbstractEventLoop,
        stats: CallStats,
        flight: FlightRecorder,
        unclaimed: Unclaimed,
    ) -> None:
        self.closed = False  # closing: cancelled calls are not aborted at the peers
        self._cancel_aborts: dict[int, asyncio.TimerHandle] = {}  # cid -> pending abort
        self._table = table
        self._tasks = tasks
        self._loop = loop
        self.stats = stats
        self.flight = flight
        self.unclaimed = unclaimed
        self._deadlines = Deadlines(loop, float(config.timeout))
        self._progress = ProgressLog(table, loop, config.progress_after, config.probe_timeout)

    def close(self) -> None:
        """The communicator closes: stop the shared deadline and the progress log."""
        self.closed = True
        self._deadlines.close()
        self._progress.close()

    async def run(self, call: Call, plan: Plan) -> Any:
        """Run the call, recording its time split (`comm.stats()`); one debug line each."""
        fp = call.fingerprint
        record = self.stats.begin(fp.collective, call.cid, call.epoch, fp, plan.nbytes)
        call.record = record
        token = current_record.set(record)  # in this task's own context: this call only
        span = profiler_span(fp.collective)
        try:
            result = await self._run_call(call, plan)
            record.outcome = "ok"
            return result
        except BaseException as exc:
            cancelled = isinstance(exc, asyncio.CancelledError)
            record.outcome = "cancelled" if cancelled else type(exc).__name__
            if isinstance(exc, DsmlError):  # a timeout, an abort, a lost peer, ...
                self.flight.failed(f"{record.outcome} in {fp.collective} #{call.cid}", str(exc))
            raise
        finally:
            record.end = time.perf_counter()
            if span is not None:
                span.__exit__(None, None, None)
            current_record.reset(token)
            if log.isEnabledFor(logging.DEBUG):
                log.debug(record.describe(), extra={"rank": self._table.rank, "epoch": call.epoch})

    async def _run_call(self, call: Call, plan: Plan) -> Any:
        deadline = None
        if call.timeout == self._deadlines.timeout:
            self._deadlines.add(call)  # the usual budget: one timer for all such calls
        else:
            deadline = self._loop.call_later(call.timeout, call.fail, DeadlinePassed())
        self._progress.add(call)  # a warning naming the late peers if it runs long
        try:
            error = call.failure or self._table.check_start(call)
            if error is not None:
                call.fail(error)  # already known to the peers: no abort from here
                raise error
            return await plan.body(call)
        except DeadlinePassed:
            raise await self._timed_out(call) from None
        except (ProtocolError, CollectiveError) as exc:
            if call.fail(exc):  # our own failure, not one delivered to us: tell the peers
                self._table.abort(call, "failed", f"rank {self._table.rank} failed: {exc}")
            raise
        finally:
            call.over = True  # its deadline no longer applies
            if deadline is not None:
                deadline.cancel()

    async def _timed_out(self, call: Call) -> CollectiveTimeoutError:
        waiting = WaitingFor.from_answers(call.cid, await self._table.probe(call))
        if call.record is not None:
            call.record.waiting_for = waiting
        message, missing = timeout_message(
            call.fingerprint, self._table.rank, call.timeout, waiting
        )
        call.failure = CollectiveTimeoutError(
            message,
            missing=missing,
            rank=self._table.rank,
            epoch=call.epoch,
            cid=call.cid,
            collective=call.fingerprint.collective,
        )
        self._table.abort(call, "timeout", message, missing)
        return call.failure

    def finished(self, call: Call, task: asyncio.Task[Any]) -> None:
        """The call's task ended: it leaves the table; tell the peers if it failed here."""
        self._table.finish(call)
        self._deadlines.forget_over()
        self._progress.end(call)
        rank = self._table.rank
        if task.cancelled() and call.failure is None:  # the user cancelled
            message = f"rank {rank} cancelled the call"
            if self.closed:
                pass  # closing: the goodbye fails it at the peers (as a member leaving)
            else:
                timer = asyncio.get_running_loop().call_later(
                    _CANCEL_ABORT_DELAY_S, self._abort_cancelled, call, message
                )
                self._cancel_aborts[call.cid] = timer
        elif not task.cancelled() and call.failure is None and task.exception() is not None:
            self._table.abort(call, "failed", f"rank {rank} failed: {task.exception()!r}")

    # -- point to point ---------------------------------------------------------------------

    def p2p(
        self,
        call: Call,
        body: Coroutine[Any, Any, T],
        what: str,
        hint: str,
        give_back: Callable[[], bool] | None = None,
    ) -> CollectiveHandle[T]:
        """Start a send or a receive; a receive's `call` is in the table while it waits, so
        a peer's goodbye or a change of view fails it. `give_back` returns a receive's
        message to its stream when the receive is given up after it took it: its task
        cancelled, or the task awaiting its handle cancelled in the turn it ended."""
        receive = call.fingerprint.collective == "recv"
        if receive:
            self._table.add_receive(call)
        call.task = self._tasks.spawn(self._run_p2p(call, body, what, hint), watched=False)
        # a task cancelled before its first step never awaits body: close it, or Python
        # warns "coroutine ... was never awaited" at exit (after a Ctrl-C, say)
        call.task.add_done_callback(lambda _t: body.close())
        if receive:
            call.task.add_done_callback(lambda _t: self._table.end_receive(call))
        if give_back is not None:
            call.task.add_done_callback(lambda t: t.cancelled() and give_back())
        return CollectiveHandle(
            call.task, call.fingerprint.collective, 0, self.unclaimed, give_back=give_back
        )

    async def _run_p2p(self, call: Call, body: Coroutine[Any, Any, T], what: str, hint: str) -> T:
        deadline = self._loop.call_later(call.timeout, call.fail, DeadlinePassed())
        try:
            if call.failure is not None:
                body.close()
                raise call.failure
            return await body
        except DeadlinePassed:
            message = f"{what} timed out after {call.timeout:g} s on rank {self._table.rank}"
            self.flight.failed(f"CollectiveTimeoutError in {what}", message)
            raise CollectiveTimeoutError(
                f"{message}: {hint}",
                missing=[call.peer] if call.peer is not None else [],
                rank=self._table.rank,
                epoch=call.epoch,
            ) from None
        finally:
            deadline.cancel()

    # -- closing ----------------------------------------------------------------------------

    def _abort_cancelled(self, call: Call, message: str) -> None:
        self._cancel_aborts.pop(call.cid, None)
        self._table.abort(call, "cancelled", message)

    def withdraw_cancel_aborts(self) -> int | None:
        """Closing: keep back the aborts of cancelled calls not sent yet; returns the
        smallest of their collective ids (the goodbye counts them as not made)."""
        first = min(self._cancel_aborts, default=None)
        for timer in self._cancel_aborts.values():
            timer.cancel()
        self._cancel_aborts.clear()
        return first

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return f"<CallRunner pending_aborts={len(self._cancel_aborts)}{state}>"
