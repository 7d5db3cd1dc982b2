"""The threaded dependency engine: `push(fn, read, mutate)` on an asyncio loop (engine layer).

How an op travels (all bookkeeping happens on the loop thread, so nothing is locked):

1. `push` checks the arguments, makes the `OpHandle`, and wires it into the graph
   (`graph.link`: an edge from each unfinished op it must wait for). With nothing to wait
   for it goes straight to the ready queue.
2. The ready queue is drained in a loop, not by recursion, so a long chain of ops failing
   on a poisoned var cannot overflow the stack. `_start` either
   * passes a cancelled op through as an empty barrier (`graph.inherit`),
   * fails an op that meets a poisoned var with DependencyFailedError (it does not run),
   * or runs it: a coroutine function as a task on the loop; a plain function on the
     engine's ThreadPoolExecutor, whose result comes back through an `Inbox` (one loop
     wake-up per burst); an awaitable result is then awaited on the loop.
3. When the op finishes, `_finish` records its outcome (poisoning the vars it mutates if
   it failed or was cancelled while running) and `graph.release` decrements its
   dependents' counts, queueing those that reach zero, and wakes `wait_*` callers.

Per op the engine does O(vars named + edges) work and one task or one pool submission;
no step scans the list of all ops. `wait_all` takes a snapshot of the unfinished ops, a
cost paid by the waiter, not by every op.

Cancellation (`OpHandle.cancel`):

* a pending op ends cancelled at once and stays in the graph as an empty barrier (see
  `handle`), so what depended on it waits for what it waited for; it poisons nothing;
* a coroutine op whose task has not taken its first step is treated the same way (its
  body never ran);
* a running loop op (a coroutine, or the awaitable a plain function returned) has its
  task cancelled: it ends cancelled and poisons the vars it mutates, because the data may
  be half written; its dependents fail with DependencyFailedError caused by the
  CancelledError. The CancelledError is re-raised in the task, never swallowed;
* a plain function inside a pool thread cannot be interrupted: cancel() returns False.
  (`aclose(cancel=True)` additionally drops the awaitable such a function returns.)
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from os import PathLike
from typing import Any

from ..errors import ConfigError
from .base import EngineBase
from .context import running
from .graph import first_poison, inherit, link, passed_on, release
from .handle import Countdown, OpHandle, Poison, Status
from .inbox import Inbox
from .spec import coroutine_not_started, dependency_error
from .trace import Span, TraceRecorder
from .var import Var

__all__ = ["Engine"]

Op = OpHandle[Any]
# What a pool thread sends back: op, returned value, raised error, start, end, thread id.
_PoolResult = tuple[Op, object, BaseException | None, float, float, int]


class Engine(EngineBase):
    """Schedules ops from the vars they read and mutate; see the module docstring.

    Args:
        max_workers: threads of the pool that runs plain functions (None: Python's default).
        trace: record each op's start, end and place for `write_trace`.
        name: shown in `repr`, errors and traces.
    """

    def __init__(
        self, *, max_workers: int | None = None, trace: bool = False, name: str = "engine"
    ) -> None:
        super().__init__(name)
        if max_workers is not None and (not isinstance(max_workers, int) or max_workers < 1):
            raise ConfigError(f"max_workers must be a positive int or None, got {max_workers!r}")
        self._max_workers = max_workers
        self._pool: ThreadPoolExecutor | None = None
        self._inbox: Inbox[_PoolResult] | None = None
        self._ready: deque[Op] = deque()
        self._draining = False
        self._cancel_all = False
        self._unfinished: set[Op] = set()
        self._tracer = TraceRecorder() if trace else None

    # -- public ----------------------------------------------------------------------------

    def _schedule(self, op: Op) -> None:
        if self._tracer is not None:
            op._t_push = time.perf_counter()
        self._unfinished.add(op)
        link(op)
        if op._npending == 0:
            self._ready.append(op)
            self._drain()

    async def wait_var(self, var: Var) -> None:
        """Wait for every op pushed so far that reads or mutates `var`.

        Raises:
            DependencyFailedError: `var` is poisoned (chained to the original error).
        """
        self._check_var(var)
        self._bind_loop()
        targets = list(var._readers)
        if var._writer is not None:
            targets.append(var._writer)
        self._refuse_waiting_for_itself(f"wait_var({var.name!r})", targets)
        source = var._poison_src
        if targets:
            await self._wait_nodes(targets)
        poison = None if source is None else source._poison_for(var)
        if poison is not None:
            raise dependency_error(f"wait_var({var.name!r})", var, poison)

    async def wait_all(self) -> None:
        """Wait for every op pushed so far; raise the first unreported failure among them."""
        self._bind_loop()
        self._refuse_waiting_for_itself("wait_all()", self._unfinished)
        before = self._seq
        if self._unfinished:
            await self._wait_nodes(list(self._unfinished))
        error = self._take_failure(before)
        if error is not None:
            raise error

    def is_busy(self, var: Var) -> bool:
        """True while an op pushed earlier that reads or mutates `var` has not finished."""
        self._check_var(var)
        return var._writer is not None or bool(var._readers)

    def clear_error(self, var: Var) -> None:
        """Clear `var`'s poison for the ops pushed after this call (earlier ones keep it)."""
        self._check_var(var)
        var._poison_src = None

    def write_trace(self, path: str | PathLike[str], extra: Iterable[Span] = ()) -> None:
        """Write the recorded ops as a Chrome / Perfetto trace (JSON) to `path`."""
        self._recorder().write(path, f"dsml engine {self.name}", extra)

    def trace(self, extra: Iterable[Span] = ()) -> dict[str, Any]:
        """The recorded ops as a Chrome trace-event dict (what `write_trace` writes), with
        `extra` spans beside them (a communicator adds its collectives)."""
        return self._recorder().chrome_trace(f"dsml engine {self.name}", extra)

    def _recorder(self) -> TraceRecorder:
        if self._tracer is None:
            raise ConfigError(
                f"engine {self.name!r} records no trace: use Engine(trace=True), or "
                "CommConfig(engine_trace=True) for a communicator's engine"
            )
        return self._tracer

    async def aclose(self, *, cancel: bool = False) -> None:
        """Refuse new pushes, wait for every pushed op, then shut the thread pool down.

        With `cancel=True` (what `async with` does when its body raised), pending ops and
        running loop ops are cancelled first. Op failures are not raised here; use
        `wait_all` for them.
        """
        self._closed = True
        if cancel:
            self._cancel_all = True
            for op in sorted(self._unfinished, key=lambda op: op.seq):
                op.cancel()
        try:
            if self._unfinished:
                await self._wait_nodes(list(self._unfinished))
        finally:
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=not self._unfinished)

    # -- scheduling (loop thread) ----------------------------------------------------------

    def _drain(self) -> None:
        if self._draining:  # an outer _drain on the stack will get to it
            return
        self._draining = True
        try:
            ready = self._ready
            while ready:
                self._start(ready.popleft())
        finally:
            self._draining = False

    def _start(self, op: Op) -> None:
        if op._status is Status.CANCELLED:
            inherit(op)
            self._release(op)
            return
        if op._always_run and op._preds:  # for a cancel before its body runs
            op._would_inherit = passed_on(op)
        hit = first_poison(op)
        if hit is not None:
            var, poison = hit
            error = dependency_error(f"op {op.name!r} did not run", var, poison)
            if op._always_run:
                op.blocked = error  # it runs all the same and may act on this
            else:
                self._record_outcome(op, Status.FAILED, error, poison)
                self._release(op)
                return
        self._mark_running(op)
        if op._is_coro:
            self._start_coro(op)
        else:
            self._start_in_pool(op)

    def _start_coro(self, op: Op) -> None:
        assert op._fn is not None
        try:
            with running(op):
                awaitable = op._fn()
        except Exception as exc:
            self._finish(op, None, exc)
            return
        self._await_on_loop(op, awaitable)

    def _start_in_pool(self, op: Op) -> None:
        assert op._fn is not None
        pool, inbox = self._pool, self._inbox
        if pool is None or inbox is None:
            pool, inbox = self._open_pool()
        try:
            op._queued = pool.submit(self._run_in_pool, op, op._fn, inbox)
        except RuntimeError as exc:  # the interpreter is shutting down
            self._finish(op, None, exc)

    def _open_pool(self) -> tuple[ThreadPoolExecutor, Inbox[_PoolResult]]:
        assert self._loop is not None
        self._pool = ThreadPoolExecutor(self._max_workers, f"dsml-{self.name}")
        self._inbox = Inbox(self._loop, self._pool_returned)
        return self._pool, self._inbox

    @staticmethod
    def _run_in_pool(op: Op, fn: Callable[[], Any], inbox: Inbox[_PoolResult]) -> None:
        """Run a plain function in a pool thread; hand what happened to the loop."""
        start = time.perf_counter()
        error: BaseException | None = None
        value: object = None
        try:
            with running(op):
                value = fn()
        except BaseException as exc:  # not swallowed: it becomes the op's outcome
            error = exc
        inbox.put((op, value, error, start, time.perf_counter(), threading.get_ident()))

    def _pool_returned(self, item: _PoolResult) -> None:
        op, value, error, start, end, thread = item
        op._queued = None
        awaits = error is None and inspect.isawaitable(value)
        if self._tracer is not None:
            outcome = "returned an awaitable" if awaits else _outcome_name(error)
            self._trace(op, "pool", thread, start, end, outcome)
        if awaits and self._cancel_all:  # closing with cancel=True: do not start waiting
            self._finish(op, None, asyncio.CancelledError(f"engine {self.name!r} closed"))
            _discard(value)
        elif awaits:
            self._await_on_loop(op, value)  # type: ignore[arg-type]
        else:
            self._finish(op, value, error)

    def _await_on_loop(self, op: Op, awaitable: Awaitable[Any]) -> None:
        assert self._loop is not None
        with running(op):  # the task copies the context: current_op() is op inside it
            op._task = self._loop.create_task(self._drive(op, awaitable))

    async def _drive(self, op: Op, awaitable: Awaitable[Any]) -> None:
        """Await an op's awaitable as a task on the loop, then finish the op."""
        if op._status is not Status.RUNNING:  # `_cancel` ended it before this task started
            op._task = None
            if not op._node_done:
                self._release(op)
            _discard(awaitable)
            return
        start = time.perf_counter()
        value: object = None
        error: BaseException | None = None
        try:
            value = await awaitable
        except BaseException as exc:  # the op's outcome; CancelledError and the like re-raised
            error = exc
        if self._tracer is not None:
            self._trace(op, "loop", 0, start, time.perf_counter(), _outcome_name(error))
        self._finish(op, value, error)
        if error is not None and not isinstance(error, Exception):
            raise error

    def _finish(self, op: Op, value: object, error: BaseException | None) -> None:
        op._task = None
        if error is None:
            self._record_outcome(op, Status.SUCCEEDED, value, None)
        elif isinstance(error, asyncio.CancelledError):
            self._record_outcome(op, Status.CANCELLED, error, Poison(error, op.name))
        else:
            self._record_outcome(op, Status.FAILED, error, Poison(error, op.name))
        self._release(op)

    def _release(self, op: Op) -> None:
        self._unfinished.discard(op)
        release(op, self._ready)
        self._drain()

    def _cancel(self, op: Op) -> bool:
        if op._status is Status.PENDING:
            self._record_outcome(op, Status.CANCELLED, None, None)
            return True  # stays in the graph as a barrier until `_start` reaches it
        queued = op._queued
        if op._status is Status.RUNNING and queued is not None and queued.cancel():
            # still waiting for a pool thread: its function never ran, as a pending op
            op._queued = None
            op._inherited = op._would_inherit or {}
            self._record_outcome(op, Status.CANCELLED, None, None)
            self._release(op)
            return True
        task = op._task
        if op._status is not Status.RUNNING or task is None or task.done():
            return False  # finished, or a plain function inside a pool thread
        if not coroutine_not_started(task):
            return task.cancel()  # `_drive` records the outcome
        # `_drive` has not started: end the op here; `_drive` will only clean up.
        if op._is_coro:  # its body never ran: like a pending op, it poisons nothing new
            op._inherited = op._would_inherit or {}
            self._record_outcome(op, Status.CANCELLED, None, None)
        else:  # its function ran in a pool thread and may have written: poison
            self._finish(op, None, asyncio.CancelledError(f"op {op.name!r} was cancelled"))
        return True

    async def _wait_nodes(self, ops: list[Op]) -> None:
        """Wait until every op in `ops` (all unfinished) has left the graph."""
        assert self._loop is not None
        countdown = Countdown(len(ops), self._loop.create_future())
        for op in ops:
            assert not op._node_done
            if op._node_waiters is None:
                op._node_waiters = []
            op._node_waiters.append(countdown)
        await countdown.future

    def _trace(
        self, op: Op, place: str, thread: int, start: float, end: float, outcome: str
    ) -> None:
        assert self._tracer is not None
        reads = tuple(v.name for v in op._reads)
        mutates = tuple(v.name for v in op._mutates)
        span = Span(op.name, op.seq, place, thread, start, end, op._t_push, outcome, reads, mutates)
        self._tracer.add(span)


def _discard(awaitable: object) -> None:
    """Drop an awaitable that will not be awaited: close a coroutine, cancel the rest."""
    if inspect.iscoroutine(awaitable):
        awaitable.close()
        return
    cancel = getattr(awaitable, "cancel", None)  # a Future, a collective handle, ...
    if callable(cancel):
        # The op has already ended as cancelled; an error from the awaitable's own
        # cancel() has nowhere better to go and must not stop the engine's bookkeeping.
        with contextlib.suppress(Exception):
            cancel()


def _outcome_name(error: BaseException | None) -> str:
    if error is None:
        return Status.SUCCEEDED.value
    if isinstance(error, asyncio.CancelledError):
        return Status.CANCELLED.value
    return Status.FAILED.value
