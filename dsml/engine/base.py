"""What the threaded and the serial engine share: vars, counters, outcomes (engine layer).

Both engines bind lazily to the event loop that first pushes to them, count ops by
state, record failures for `wait_all`, and close through `aclose()` / `async with`. Only
the scheduling differs, so that is all `Engine` and `SerialEngine` define.

`wait_all` reports each failure once: the engine keeps the failed ops not yet reported,
and a `wait_all` raises the first of them (in push order) among the ops pushed before it
was called, then forgets those. Poison on vars is separate and stays until `clear_error`.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable
from types import TracebackType
from typing import Any, Self, TypeVar, overload

from ..errors import ConfigError
from .context import current_op
from .handle import OpHandle, Poison, Status
from .spec import check_callable, is_coroutine_fn, op_name, split_vars
from .tagged import Tagged
from .var import Var

T = TypeVar("T")

__all__ = ["EngineBase"]


class EngineBase(ABC):
    """Vars, op records, counters and closing, common to `Engine` and `SerialEngine`."""

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"an engine needs a non-empty name, got {name!r}")
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._seq = 0
        self._var_count = 0
        self._pending = 0
        self._running = 0
        self._succeeded = 0
        self._failed = 0
        self._cancelled = 0
        #: failed ops whose error nobody has seen yet (by seq): wait_all raises the first;
        #: seeing it through the op's handle (await, result, exception) also reports it,
        #: so a loop that handles each op's error keeps nothing (and no traceback) here
        self._unreported: dict[int, OpHandle[Any]] = {}

    # -- public ----------------------------------------------------------------------------

    def new_var(self, name: str) -> Var:
        """Create a var (a tag for one piece of data) owned by this engine."""
        self._var_count += 1
        return Var(str(name), self)

    def tag(self, name: str, data: T) -> Tagged[T]:
        """Tag `data` with a new var: `t.data` is the data, `t.var` its var."""
        return Tagged(data, self.new_var(name))

    def statistics(self) -> dict[str, int]:
        """Return op counts: pushed, pending, running, done (succeeded), failed, cancelled."""
        return {
            "pushed": self._seq,
            "pending": self._pending,
            "running": self._running,
            "done": self._succeeded,
            "failed": self._failed,
            "cancelled": self._cancelled,
            "vars": self._var_count,
        }

    @property
    def closed(self) -> bool:
        """True once `aclose()` was called; pushing then raises RuntimeError."""
        return self._closed

    @overload
    def push(
        self,
        fn: Callable[[], Awaitable[T]],
        read: Iterable[Var] = (),
        mutate: Iterable[Var] = (),
        name: str | None = None,
        *,
        always_run: bool = False,
    ) -> OpHandle[T]: ...
    @overload
    def push(
        self,
        fn: Callable[[], T],
        read: Iterable[Var] = (),
        mutate: Iterable[Var] = (),
        name: str | None = None,
        *,
        always_run: bool = False,
    ) -> OpHandle[T]: ...
    def push(
        self,
        fn: Callable[[], Any],
        read: Iterable[Var] = (),
        mutate: Iterable[Var] = (),
        name: str | None = None,
        *,
        always_run: bool = False,
    ) -> OpHandle[Any]:
        """Schedule `fn` after the ops it depends on; return its handle at once.

        `fn` is a coroutine function (awaited on the loop) or a plain function (run on the
        engine's thread pool; an awaitable it returns is then awaited on the loop). Must be
        called from the thread running the engine's event loop.

        With `always_run`, the op runs in its turn even if a var it touches is poisoned
        (and, if it succeeds, the vars it mutates are clean again). The communicator uses
        it for the ops that take a collective's turn: every rank must take it.

        Raises:
            ConfigError: `fn` is not callable, or a var is not one of this engine's.
            RuntimeError: the engine is closed, or this is not its loop's thread.
        """
        op = self._new_op(fn, read, mutate, name)
        op._always_run = always_run
        self._schedule(op)
        return op

    @abstractmethod
    def _schedule(self, op: OpHandle[Any]) -> None:
        """Take a freshly made op into this engine's schedule."""

    @abstractmethod
    async def aclose(self, *, cancel: bool = False) -> None:
        """Wait for every pushed op (cancelling them first if `cancel`), then release."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Leaving on an error (or a cancellation) cancels what has not run yet.
        await self.aclose(cancel=exc_type is not None)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<{type(self).__name__} {self.name!r} {state} pushed={self._seq} "
            f"pending={self._pending} running={self._running} done={self._succeeded} "
            f"failed={self._failed} cancelled={self._cancelled} vars={self._var_count}>"
        )

    # -- for the subclasses ----------------------------------------------------------------

    @abstractmethod
    def _cancel(self, op: OpHandle[Any]) -> bool: ...

    def _new_op(
        self, fn: Callable[[], Any], read: Iterable[Var], mutate: Iterable[Var], name: str | None
    ) -> OpHandle[Any]:
        """Check a push and make its op record (counted as pending)."""
        if self._closed:
            raise RuntimeError(f"engine {self.name!r} is closed; push to an open engine")
        self._bind_loop()
        check_callable(fn)
        reads, mutates = split_vars(self, self.name, read, mutate)
        op: OpHandle[Any] = OpHandle(
            self, self._seq, op_name(fn, name), fn, is_coroutine_fn(fn), reads, mutates
        )
        self._seq += 1
        self._pending += 1
        return op

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        """Return the engine's loop, binding it to the running one on first use."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                f"engine {self.name!r} must be used from the thread running its event loop"
            ) from None
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError(f"engine {self.name!r} belongs to another event loop")
        return loop

    def _refuse_waiting_for_itself(self, what: str, ops: Iterable[OpHandle[Any]]) -> None:
        """ConfigError when the op running here is among `ops`, or one of `ops` waits for
        it through the graph (pushed after it, on a var it reads or mutates): either way
        it would wait forever."""
        me = current_op()
        if me is None or me._owner is not self or me.done():
            return
        ops = set(ops)
        fix = "wait outside the op, or push what comes after as an op"
        if me in ops:
            raise ConfigError(
                f"op {me.name!r} called {what}, which waits for the op itself: it would "
                f"never return; {fix}"
            )
        behind = _waiting_behind(me, ops)
        if behind is not None:
            raise ConfigError(
                f"op {me.name!r} called {what}, which waits for op {behind.name!r}, but that "
                f"op waits for {me.name!r} (it was pushed after it, on a var they share, "
                f"directly or through other ops): it would never return; {fix}"
            )

    def _check_var(self, var: Var) -> None:
        split_vars(self, self.name, (var,), ())

    def _mark_running(self, op: OpHandle[Any]) -> None:
        op._status = Status.RUNNING
        self._pending -= 1
        self._running += 1
        for var in op._mutates:
            if var._watch is not None:
                var._watch.started(op)

    def _record_outcome(
        self, op: OpHandle[Any], status: Status, value: object, poison: Poison | None
    ) -> None:
        """Count the op's outcome, keep its poison, wake whoever awaits its handle."""
        ran = op._status is Status.RUNNING
        failed = isinstance(value, BaseException) and status is not Status.SUCCEEDED
        for var in op._mutates:
            if var._watch is not None:
                var._watch.ended(op, value if failed else None, ran)  # type: ignore[arg-type]
        if op._status is Status.PENDING:
            self._pending -= 1
        elif op._status is Status.RUNNING:
            self._running -= 1
        if status is Status.SUCCEEDED:
            self._succeeded += 1
        elif status is Status.FAILED:
            self._failed += 1
            self._unreported[op.seq] = op
        else:
            self._cancelled += 1
        op._poison = poison
        op._resolve(status, value)

    def _take_failure(self, before_seq: int) -> BaseException | None:
        """Forget unreported failures of ops pushed before `before_seq`; return the first."""
        mine = [op for seq, op in self._unreported.items() if seq < before_seq]
        if not mine:
            return None
        for op in mine:
            del self._unreported[op.seq]
        first = min(mine, key=lambda op: op.seq)
        return first.exception()

    def _observed(self, op: OpHandle[Any]) -> None:
        """The op's error was seen through its handle: reported, no longer kept."""
        self._unreported.pop(op.seq, None)


def _waiting_behind(op: OpHandle[Any], targets: set[OpHandle[Any]]) -> OpHandle[Any] | None:
    """One of `targets` that cannot start before `op` ends (reached from `op` along the
    dependency edges), or None. Only unfinished ops keep edges, so the walk stays within
    the ops still pending."""
    if not targets:
        return None
    seen: set[int] = set()
    stack = list(op._dependents)
    while stack:
        later = stack.pop()
        if id(later) in seen:
            continue
        seen.add(id(later))
        if later in targets:
            return later
        stack.extend(later._dependents)
    return None
