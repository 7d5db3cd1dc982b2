"""Starting and running calls: ids, tasks, deadlines, aborts (communicator layer).

A collective takes the next collective id when it is called (program order is collective
order) and runs as a task of the communicator at once. The runner plans the call, gives it
its deadline, turns a failure delivered to it (a peer's abort, a lost peer, its deadline)
into this rank's error, aborts the peers when this rank fails or the user cancels, and
asks the peers where they are before reporting a timeout. It also hands calls made from
other threads (the engine's pool) to the communicator's loop.

`Runner` holds the communicator's state (closed, broken), hands calls over to its loop,
and admits, numbers, plans and starts each call (or rejects it) in program order; once
started, a call runs as a task of its `CallRunner` (runner_calls.py, owned by the runner),
whose default deadline is kept by `Deadlines` (deadlines.py, re-exported here) and which
the progress log watches when it runs long (progress.py). Closing drains or cancels them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import logging
import math
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ..config import CommConfig
from ..engine import current_op
from ..errors import CollectiveError, ConcurrentCallsError, ConfigError, DsmlError
from .call import Call
from .call_table import CallTable
from .collective_handle import (
    CollectiveHandle,
    Unclaimed,
    call_site,
    caller_site,
    cancel_on_close,
)
from .deadlines import Deadlines
from .flight import FlightRecorder
from .plans import PlanState, Request
from .plans import plan as make_plan
from .runner_calls import CallRunner
from .stats import CallStats
from .tasks import TaskOwner
from .view_changes import Views

__all__ = ["Deadlines", "Runner"]

T = TypeVar("T")

log = logging.getLogger("dsml.communicator")


class Runner:
    """Runs the calls of one communicator on its event loop."""

    def __init__(
        self,
        table: CallTable,
        views: Views,
        plans: PlanState,
        tasks: TaskOwner,
        config: CommConfig,
        loop: asyncio.AbstractEventLoop,
        flight_dir: str | None = None,
    ) -> None:
        self.closed = False
        #: set when the communicator failed (a bug met in its own machinery): every call
        #: in flight fails with it, and so does every later call
        self.broken: DsmlError | None = None
        self._table = table
        self._views = views
        self._plans = plans
        self._tasks = tasks
        self._config = config
        self._loop = loop
        self._deferred = 0  # calls waiting for a change of view, in program order
        self._waiting: set[asyncio.Task[Any]] = set()  # ... and their tasks
        self._admission = asyncio.Lock()
        #: handles of calls whose result nobody took yet (named when the communicator closes)
        self.unclaimed: Unclaimed = {}
        #: the thread (not the loop's) whose calls are in flight, and how many: calls from
        #: two threads at once have no order the ranks agree on (see `_check_thread`)
        self._thread: threading.Thread | None = None
        self._thread_calls: list[Any] = []  # their handles (done ones pruned when checked)
        self.stats = CallStats()  # the recent calls and where their time went
        self.flight = FlightRecorder(table, self.stats, flight_dir)  # written on failures
        #: runs each started call as its task (runner_calls.py)
        self.calls = CallRunner(table, tasks, config, loop, self.stats, self.flight, self.unclaimed)
        self._run = self.calls.run  # bound once: no lookup through `calls` per call
        self._finished = self.calls.finished

    def budget(self, timeout: float | None) -> float:
        """A call's timeout in seconds (the configured default when None)."""
        budget = self._config.timeout if timeout is None else timeout
        if not isinstance(budget, int | float) or not math.isfinite(budget) or budget <= 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        return float(budget)

    def on_own_loop(self) -> bool:
        """Whether a call made now runs at once: this communicator is usable and the caller
        runs on its loop (else `on_loop` hands the call over, or says what is wrong)."""
        if self.closed or self.broken is not None:
            return False
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def on_loop(self, start: Callable[[], T]) -> T:
        """Run start() on the communicator's loop, also when called from another thread.

        From another thread the call waits until the loop has run it; the caller's context
        variables go with it (the engine marks its ops with one).
        """
        if self.closed:
            raise ConfigError("this communicator is closed")
        if self.broken is not None:
            raise self.broken
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            return start()
        if running is not None:
            raise ConfigError("this communicator belongs to another event loop")
        if not self._loop.is_running():
            raise ConfigError(
                "collectives must be started from async code while the communicator's event "
                "loop runs (or from a thread while it runs)"
            )
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        context = contextvars.copy_context()
        context.run(call_site.set, caller_site())  # the user's frame is in this thread
        thread = threading.current_thread()

        def call() -> None:
            try:
                self._check_thread(thread, context)
                started = context.run(start)
                self._count_thread_call(thread, context, started)
                done.set_result(started)
            except BaseException as exc:  # handed to the calling thread, which raises it
                done.set_exception(exc)

        try:
            self._loop.call_soon_threadsafe(call)
        except RuntimeError:  # closed meanwhile
            raise ConfigError("the communicator's event loop is closed") from None
        return done.result()

    def _check_thread(self, thread: threading.Thread, context: contextvars.Context) -> None:
        """Refuse a call from this thread while calls made from another one are in flight
        (runs on the loop, so checks never race). Calls in two threads have no order
        every rank shares: rank 0 could issue A's then B's, rank 1 B's then A's, and
        same-shaped calls would pair wrongly (wrong sums, no error). Calls made inside an
        engine op are ordered by the engine (`comm.var`) and are not counted."""
        self._thread_calls = [h for h in self._thread_calls if not h.done()]
        if not self._thread_calls:
            self._thread = None
        owner = self._thread
        if owner is None or owner is thread or _in_engine_op(context):
            return
        raise ConcurrentCallsError(
            f"a collective was called from thread {thread.name!r} while calls made from "
            f"thread {owner.name!r} are still in flight on rank {self._table.rank}: calls "
            "must come in one order on every rank, so make them from one thread at a time "
            "(wait for one thread's calls before another calls), or push them into "
            "comm.engine with comm.var"
        )

    def _count_thread_call(
        self, thread: threading.Thread, context: contextvars.Context, started: object
    ) -> None:
        """Count a call made from another thread in flight until its handle is done."""
        if not hasattr(started, "done") or _in_engine_op(context):
            return
        self._thread = thread
        self._thread_calls.append(started)

    def fail(self, error: DsmlError) -> None:
        """The communicator is broken: fail every call in flight, and every later one."""
        if self.broken is None:
            self.broken = error
        for call in [*self._table.calls.values(), *self._table.receives]:
            if call.fail(error) and call.cid:  # a collective: its peers must not wait for it
                self._table.abort(call, "failed", f"rank {self._table.rank} failed: {error}")

    # -- collectives ------------------------------------------------------------------------

    def collective(self, request: Request) -> CollectiveHandle[Any]:
        """Take the next collective id, plan the call and start it; returns its handle.

        Must run on the communicator's loop (see `on_loop`). While the group changes the
        call first waits its turn (`ViewChanges.admit`), behind the calls made before it.
        """
        if self.broken is not None:
            raise self.broken
        if self._deferred or not self._views.immediate():
            self._deferred += 1
            task = self._tasks.spawn(self._admit_then_run(request), watched=False)
            self._waiting.add(task)
            task.add_done_callback(self._waiting.discard)
            return CollectiveHandle(task, request.collective, 0, self.unclaimed)
        call = self._start(request)
        assert call.task is not None
        return CollectiveHandle(call.task, call.fingerprint.collective, call.cid, self.unclaimed)

    async def _admit_then_run(self, request: Request) -> Any:
        try:
            async with self._admission:
                await self._views.admit()
                call = self._start(request)
        finally:
            self._deferred -= 1
        assert call.task is not None
        return await call.task

    def _start(self, request: Request) -> Call:
        cid = self._table.take_cid()
        try:
            budget = self.budget(request.timeout)
            plan = make_plan(self._plans, request, self._table.rank, self._table.size)
        except ConfigError as exc:
            rejected = Call(self._table, cid, request.loose_fingerprint(), self._config.timeout)
            reason = f"rank {self._table.rank} rejected its arguments: {exc}"
            self._table.abort(rejected, "invalid", reason)
            self._table.forget(cid)
            raise
        call = Call(self._table, cid, plan.fingerprint, budget)
        self._table.register(call)
        call.task = self._tasks.spawn(self._run(call, plan), watched=False)
        call.task.add_done_callback(functools.partial(self._finished, call))
        return call

    @property
    def turns(self) -> int:
        """Collective ids this rank has taken or is about to take (a monotonic count)."""
        return self._table.turns_taken + self._deferred

    def skip_turn(self, reason: str) -> None:
        """Take the next collective id for an engine op that mutates `comm.var` and made
        no collective here (it did not run, a var it touches being poisoned, or it failed
        first), and fail it on every peer: the op made its collective there, and without
        this turn this rank's ids fell one behind the others' for good, pairing later calls
        of the same shape with the wrong ones (silent wrong sums). The peers' matching call
        (the first their op makes, which then ends that op) fails with
        `CollectiveAbortedError` saying why."""
        self.reject(Request("skipped_op"), reason, why="skipped")

    def reject(self, request: Request, reason: str, *, why: str = "failed") -> None:
        """Take the next collective id without running it, and fail it on every peer.

        For a call this rank cannot make (its input is poisoned): its turn is taken like
        any other, so the ranks' collective ids stay in step, and the peers fail loudly
        rather than pair this id with a later call.
        """
        if self._deferred or not self._views.immediate():
            self._deferred += 1
            self._tasks.spawn(self._admit_then_reject(request, reason, why))
            return
        self._reject_now(request, reason, why)

    async def _admit_then_reject(self, request: Request, reason: str, why: str) -> None:
        try:
            async with self._admission:
                await self._views.admit()
                self._reject_now(request, reason, why)
        except (CollectiveError, ConfigError):
            pass  # the group changed: there is no call left to fail on the peers
        finally:
            self._deferred -= 1

    def _reject_now(self, request: Request, reason: str, why: str) -> None:
        cid = self._table.take_cid()
        rejected = Call(self._table, cid, request.loose_fingerprint(), self._config.timeout)
        self._table.abort(rejected, why, f"rank {self._table.rank} could not take part: {reason}")
        self._table.forget(cid)

    # -- closing ----------------------------------------------------------------------------

    async def drain(self, grace_s: float) -> None:
        """Let the collectives in flight finish, for up to `grace_s` (a graceful close)."""
        tasks = [c.task for c in self._table.calls.values() if c.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)

    async def cancel_all(self) -> None:
        """Refuse new calls and cancel every call in flight (the peers are told): closing
        the communicator gives them up, as the user's cancel would."""
        self.closed = True
        self._report_unclaimed()
        self.calls.close()
        tasks = [c.task for c in self._table.calls.values() if c.task is not None]
        tasks += [r.task for r in self._table.receives if r.task is not None]
        tasks += list(self._waiting)
        for task in tasks:
            cancel_on_close(task)  # its handle raises CollectiveAbortedError
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)

    def _report_unclaimed(self) -> None:
        """Closing: name the calls whose results were never awaited (a log warning)."""
        handles = [ref() for ref in list(self.unclaimed.values())]
        calls = sorted(
            (h for h in handles if h is not None and not h.cancelled()), key=lambda h: h.cid
        )
        if calls:
            log.warning(
                "closing with %d collective(s) whose results were never awaited: %s",
                len(calls),
                ", ".join(h.describe() for h in calls),
                extra={"rank": self._table.rank},
            )

    def __repr__(self) -> str:
        state = " closed" if self.closed else " broken" if self.broken else ""
        return f"<Runner deferred={self._deferred} tasks={len(self._tasks)}{state}>"


def _in_engine_op(context: contextvars.Context) -> bool:
    """Whether the call comes from inside an engine op (the engine orders it)."""
    return context.run(current_op) is not None
