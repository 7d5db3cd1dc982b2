"""The serial reference engine: every op to completion, in push order (engine layer).

`SerialEngine` has the public surface of `Engine` and the same meaning, reached the
simplest possible way, so tests can use it as the oracle: a FIFO of pushed items and one
worker task that takes them one at a time. Plain functions run inline on the loop (there
is no pool); any awaitable they return, like a coroutine op's coroutine, is awaited before
the next item starts. Poison is a table var -> `Poison`, updated as ops finish.

Things that must happen "at a point in push order" are queued as markers and handled by
the worker when it reaches them: `clear_error` (affects later ops only) and the probes
behind `wait_var` / `wait_all` (which answer with the state at that point).
"""

from __future__ import annotations

import asyncio
import inspect
from collections import deque
from dataclasses import dataclass
from typing import Any

from .base import EngineBase
from .context import running
from .handle import OpHandle, Poison, Status
from .spec import coroutine_not_started, dependency_error
from .var import Var

__all__ = ["SerialEngine"]

Op = OpHandle[Any]


@dataclass(frozen=True, slots=True)
class _Clear:
    var: Var


@dataclass(frozen=True, slots=True)
class _Probe:
    """Answered with the var's poison (or, for var=None, the wait_all failure)."""

    var: Var | None
    before: int
    future: asyncio.Future[BaseException | None]


class SerialEngine(EngineBase):
    """Reference engine: same API and semantics as `Engine`, one op at a time."""

    def __init__(self, *, name: str = "serial") -> None:
        super().__init__(name)
        self._queue: deque[Op | _Clear | _Probe] = deque()
        self._worker: asyncio.Task[None] | None = None
        self._current: Op | None = None
        self._poison: dict[Var, Poison] = {}

    def _schedule(self, op: Op) -> None:
        """Queue the op; it runs after every op pushed before it has finished."""
        self._enqueue(op)

    async def wait_var(self, var: Var) -> None:
        """Wait for the ops pushed so far; raise DependencyFailedError if `var` is poisoned."""
        self._check_var(var)
        self._refuse_waiting_for_itself(f"wait_var({var.name!r})", self._running_op())
        error: BaseException | None = await self._probe(var)
        if error is not None:
            raise error

    async def wait_all(self) -> None:
        """Wait for the ops pushed so far; raise the first unreported failure among them."""
        self._refuse_waiting_for_itself("wait_all()", self._running_op())
        error = await self._probe(None)
        if error is not None:
            raise error

    def clear_error(self, var: Var) -> None:
        """Clear `var`'s poison for the ops pushed after this call (earlier ones keep it)."""
        self._check_var(var)
        self._bind_loop()
        self._enqueue(_Clear(var))

    async def aclose(self, *, cancel: bool = False) -> None:
        """Refuse new pushes and wait for the queue to empty (cancelling it if `cancel`)."""
        self._closed = True
        if cancel:
            for item in list(self._queue):
                if isinstance(item, OpHandle):
                    item.cancel()
            if self._current is not None:
                self._current.cancel()
        if self._worker is not None:
            await asyncio.shield(self._worker)

    # -- the worker ------------------------------------------------------------------------

    def _enqueue(self, item: Op | _Clear | _Probe) -> None:
        self._queue.append(item)
        if self._worker is None or self._worker.done():
            assert self._loop is not None
            self._worker = self._loop.create_task(self._work(), name=f"dsml-{self.name}")

    async def _probe(self, var: Var | None) -> BaseException | None:
        loop = self._bind_loop()
        probe = _Probe(var, self._seq, loop.create_future())
        self._enqueue(probe)
        return await probe.future

    async def _work(self) -> None:
        queue = self._queue
        while queue:
            item = queue.popleft()
            if isinstance(item, OpHandle):
                if item._status is Status.PENDING:  # else cancelled while queued
                    await self._run(item)
            elif isinstance(item, _Clear):
                self._poison.pop(item.var, None)
            elif not item.future.done():
                item.future.set_result(self._answer(item))

    def _answer(self, probe: _Probe) -> BaseException | None:
        if probe.var is None:
            return self._take_failure(probe.before)
        poison = self._poison.get(probe.var)
        if poison is None:
            return None
        return dependency_error(f"wait_var({probe.var.name!r})", probe.var, poison)

    async def _run(self, op: Op) -> None:
        for var in (*op._reads, *op._mutates):
            poison = self._poison.get(var)
            if poison is not None:
                error = dependency_error(f"op {op.name!r} did not run", var, poison)
                if op._always_run:
                    op.blocked = error
                    break
                self._settle(op, Status.FAILED, error, poison)
                return
        self._mark_running(op)
        self._current = op
        try:
            await self._call(op)
        finally:
            self._current = None

    def _running_op(self) -> list[Op]:
        """The op running now (one at a time here): any wait from inside it waits for it."""
        return [] if self._current is None else [self._current]

    async def _call(self, op: Op) -> None:
        assert op._fn is not None
        try:
            with running(op):  # current_op() is op inside it, as in the threaded engine
                value = op._fn()
        except asyncio.CancelledError as exc:  # raised by the function itself: its outcome
            self._settle(op, Status.CANCELLED, exc, Poison(exc, op.name))
            return
        except Exception as exc:
            self._settle(op, Status.FAILED, exc, Poison(exc, op.name))
            return
        if not inspect.isawaitable(value):
            self._settle(op, Status.SUCCEEDED, value, None)
            return
        with running(op):  # the task copies the context
            task = asyncio.ensure_future(value)
        await self._await(op, task)

    async def _await(self, op: Op, task: asyncio.Future[Any]) -> None:
        op._task = task
        try:
            await asyncio.wait([task])  # returns whether the task failed or was cancelled
        except asyncio.CancelledError:  # the worker itself is cancelled: take the op along
            task.cancel()
            raise
        finally:
            op._task = None
        if op._status is Status.CANCELLED:  # cancelled before its body ran: no poison
            return
        if task.cancelled():
            error: BaseException = asyncio.CancelledError(f"op {op.name!r} was cancelled")
            self._settle(op, Status.CANCELLED, error, Poison(error, op.name))
        elif (exc := task.exception()) is not None:
            self._settle(op, Status.FAILED, exc, Poison(exc, op.name))
        else:
            self._settle(op, Status.SUCCEEDED, task.result(), None)

    def _settle(self, op: Op, status: Status, value: object, poison: Poison | None) -> None:
        self._record_outcome(op, status, value, poison)
        for var in op._mutates:
            if poison is not None:
                self._poison[var] = poison
            elif op._always_run:  # it ran despite the poison and wrote the var afresh
                self._poison.pop(var, None)

    def _cancel(self, op: Op) -> bool:
        if op._status is Status.PENDING:
            self._record_outcome(op, Status.CANCELLED, None, None)
            return True
        task = op._task
        if op._status is not Status.RUNNING or task is None or task.done():
            return False
        if op._is_coro and coroutine_not_started(task):
            self._record_outcome(op, Status.CANCELLED, None, None)
        return task.cancel()
