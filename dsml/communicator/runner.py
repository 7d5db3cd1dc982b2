"""Starting and running calls: ids, tasks, deadlines, aborts (communicator layer).

A collective takes the next collective id when it is called (program order is collective
order) and runs as a task of the communicator at once. The runner plans the call, gives it
its deadline, turns a failure delivered to it (a peer's abort, a lost peer, its deadline)
into this rank's error, aborts the peers when this rank fails or the user cancels, and
asks the peers where they are before reporting a timeout. It also hands calls made from
other threads (the engine's pool) to the communicator's loop.

The runner is the only writer of the call table.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import functools
import logging
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ..config import CommConfig
from ..errors import (
    CollectiveError,
    CollectiveTimeoutError,
    ConfigError,
    DsmlError,
    ProtocolError,
)
from .call import Call, DeadlinePassed
from .call_table import CallTable
from .collective_handle import CollectiveHandle
from .diagnose import timeout_message
from .plans import Plan, Planner, Request
from .stats import CallStats, profiler_span
from .stats import current as current_record
from .tasks import TaskOwner
from .view_changes import ViewChanges

__all__ = ["Runner"]

#: A call the user cancelled is aborted at the peers after this delay, unless the
#: communicator closes meanwhile (an interrupt cancels the call, then closes): its
#: goodbye then names the call as the first one this rank did not make, so every peer
#: fails that same call as a member leaving (MemberLeftError), not as an abort.
_CANCEL_ABORT_DELAY_S = 0.05

T = TypeVar("T")

log = logging.getLogger("dsml.communicator")


class Runner:
    """Runs the calls of one communicator on its event loop."""

    def __init__(
        self,
        table: CallTable,
        views: ViewChanges,
        planner: Planner,
        tasks: TaskOwner,
        config: CommConfig,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.closed = False
        self._cancel_aborts: dict[int, asyncio.TimerHandle] = {}  # cid -> pending abort
        #: set when the communicator failed (a bug met in its own machinery): every call
        #: in flight fails with it, and so does every later call
        self.broken: DsmlError | None = None
        self._table = table
        self._views = views
        self._planner = planner
        self._tasks = tasks
        self._config = config
        self._loop = loop
        self._deferred = 0  # calls waiting for a change of view, in program order
        self._waiting: set[asyncio.Task[Any]] = set()  # ... and their tasks
        self._admission = asyncio.Lock()
        self.stats = CallStats()  # the recent calls and where their time went
        self._deadlines = Deadlines(loop, float(config.timeout))

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

        def call() -> None:
            try:
                done.set_result(context.run(start))
            except BaseException as exc:  # handed to the calling thread, which raises it
                done.set_exception(exc)

        try:
            self._loop.call_soon_threadsafe(call)
        except RuntimeError:  # closed meanwhile
            raise ConfigError("the communicator's event loop is closed") from None
        return done.result()

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
            return CollectiveHandle(task, request.collective, 0)
        call = self._start(request)
        assert call.task is not None
        return CollectiveHandle(call.task, call.fingerprint.collective, call.cid)

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
            plan = self._planner.plan(request, self._table.rank, self._table.size)
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

    def reject(self, request: Request, reason: str) -> None:
        """Take the next collective id without running it, and fail it on every peer.

        For a call this rank cannot make (its input is poisoned): its turn is taken like
        any other, so the ranks' collective ids stay in step, and the peers fail loudly
        rather than pair this id with a later call.
        """
        if self._deferred or not self._views.immediate():
            self._deferred += 1
            self._tasks.spawn(self._admit_then_reject(request, reason))
            return
        self._reject_now(request, reason)

    async def _admit_then_reject(self, request: Request, reason: str) -> None:
        try:
            async with self._admission:
                await self._views.admit()
                self._reject_now(request, reason)
        except (CollectiveError, ConfigError):
            pass  # the group changed: there is no call left to fail on the peers
        finally:
            self._deferred -= 1

    def _reject_now(self, request: Request, reason: str) -> None:
        cid = self._table.take_cid()
        rejected = Call(self._table, cid, request.loose_fingerprint(), self._config.timeout)
        self._table.abort(
            rejected, "failed", f"rank {self._table.rank} could not take part: {reason}"
        )
        self._table.forget(cid)

    async def _run(self, call: Call, plan: Plan) -> Any:
        """Run the call, recording its time split (`comm.stats()`); one debug line each."""
        fp = call.fingerprint
        record = self.stats.begin(fp.collective, call.cid, call.epoch, fp)
        token = current_record.set(record)  # in this task's own context: this call only
        span = profiler_span(fp.collective)
        try:
            result = await self._run_call(call, plan)
            record.outcome = "ok"
            return result
        except BaseException as exc:
            cancelled = isinstance(exc, asyncio.CancelledError)
            record.outcome = "cancelled" if cancelled else type(exc).__name__
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
        progress = await self._table.probe(call)
        message, missing = timeout_message(
            call.cid, call.fingerprint, self._table.rank, call.timeout, progress
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

    def _finished(self, call: Call, task: asyncio.Task[Any]) -> None:
        self._table.finish(call)
        self._deadlines.forget_over()
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
    ) -> CollectiveHandle[T]:
        """Start a send or a receive; a receive's `call` is in the table while it waits, so
        a peer's goodbye or a change of view fails it."""
        receive = call.fingerprint.collective == "recv"
        if receive:
            self._table.add_receive(call)
        call.task = self._tasks.spawn(self._run_p2p(call, body, what, hint), watched=False)
        if receive:
            call.task.add_done_callback(lambda _t: self._table.end_receive(call))
        return CollectiveHandle(call.task, call.fingerprint.collective, 0)

    async def _run_p2p(self, call: Call, body: Coroutine[Any, Any, T], what: str, hint: str) -> T:
        deadline = self._loop.call_later(call.timeout, call.fail, DeadlinePassed())
        try:
            if call.failure is not None:
                body.close()
                raise call.failure
            return await body
        except DeadlinePassed:
            raise CollectiveTimeoutError(
                f"{what} timed out after {call.timeout:g} s on rank {self._table.rank}: {hint}",
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

    async def drain(self, grace_s: float) -> None:
        """Let the collectives in flight finish, for up to `grace_s` (a graceful close)."""
        tasks = [c.task for c in self._table.calls.values() if c.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)

    async def cancel_all(self) -> None:
        """Refuse new calls and cancel every call in flight (the peers are told): closing
        the communicator gives them up, as the user's cancel would."""
        self.closed = True
        self._deadlines.close()
        tasks = [c.task for c in self._table.calls.values() if c.task is not None]
        tasks += [r.task for r in self._table.receives if r.task is not None]
        tasks += list(self._waiting)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)

    def __repr__(self) -> str:
        state = " closed" if self.closed else " broken" if self.broken else ""
        return f"<Runner deferred={self._deferred} tasks={len(self._tasks)}{state}>"


class Deadlines:
    """The deadlines of calls that have the default budget, kept with one timer.

    Such calls start in order with the same budget, so their deadlines come in the order
    they were added: a queue, whose head is the next deadline, replaces a timer per call
    (made and cancelled on every call). Calls are dropped from the head once over.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self.timeout = timeout
        self._loop = loop
        self._calls: collections.deque[tuple[float, Call]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None

    def add(self, call: Call) -> None:
        """Fail `call` with `DeadlinePassed` once `timeout` has passed, unless it is over."""
        when = self._loop.time() + self.timeout
        self._calls.append((when, call))
        if self._timer is None:
            self._timer = self._loop.call_at(when, self._expire)

    def forget_over(self) -> None:
        """Drop the calls at the head that are over (called as calls finish)."""
        calls = self._calls
        while calls and calls[0][1].over:
            calls.popleft()

    def _expire(self) -> None:
        self._timer = None
        self.forget_over()
        now = self._loop.time()
        while self._calls:
            when, call = self._calls[0]
            if when > now:
                self._timer = self._loop.call_at(when, self._expire)
                return
            self._calls.popleft()
            if not call.over:
                call.fail(DeadlinePassed())

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def __repr__(self) -> str:
        return f"<Deadlines {len(self._calls)} calls, {self.timeout:g} s each>"
