"""The op record and its awaitable handle (engine layer).

`engine.push(...)` returns an `OpHandle`. The same object is the engine's record of the
op (one allocation per op): its public face is asyncio-like (`await handle`, `done()`,
`result()`, `exception()`, `cancel()`), and its private slots hold what the scheduler
needs (dependency count, dependents, poison predecessors, running task).

Two notions of "finished" live here and must not be confused:

* the *outcome* (`_status`): what the user sees. An op cancelled before it started has its
  outcome at once;
* the *node* (`_node_done`): the op's place in the dependency graph. A cancelled op stays
  in the graph as an empty barrier until what it waited for has finished, so that ops
  which depended on it wait for that instead (no graph surgery, no deadlock).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast

if TYPE_CHECKING:
    from .var import Var

__all__ = ["Countdown", "OpHandle", "Poison", "Status"]

T = TypeVar("T")


class Status(enum.Enum):
    """Outcome of an op as its handle reports it."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


_OPEN = (Status.PENDING, Status.RUNNING)


@dataclass(frozen=True, slots=True)
class Poison:
    """Why a var is poisoned: the original error and the name of the op that raised it."""

    error: BaseException
    origin: str


class Countdown:
    """A future that completes after `tick()` was called `count` times (count > 0)."""

    __slots__ = ("_left", "future")

    def __init__(self, count: int, future: asyncio.Future[None]) -> None:
        self._left = count
        self.future = future

    def tick(self) -> None:
        """Count one event; complete the future on the last one (unless its waiter left)."""
        self._left -= 1
        if self._left == 0 and not self.future.done():
            self.future.set_result(None)


class _Owner(Protocol):
    def _cancel(self, op: OpHandle[Any]) -> bool: ...

    def _observed(self, op: OpHandle[Any]) -> None: ...


class OpHandle(Generic[T]):
    """Awaitable handle of one pushed op; `await handle` gives the op's result.

    Awaiting a handle never cancels the op, even when the awaiting task is cancelled or
    times out; only `cancel()` does.
    """

    __slots__ = (
        "_always_run",
        "_cancel_hook",
        "_dependents",
        "_fn",
        "_inherited",
        "_is_coro",
        "_mutates",
        "_node_done",
        "_node_waiters",
        "_npending",
        "_outcome_waiters",
        "_owner",
        "_poison",
        "_preds",
        "_queued",
        "_reads",
        "_status",
        "_t_push",
        "_task",
        "_value",
        "_would_inherit",
        "blocked",
        "name",
        "seq",
    )

    def __init__(
        self,
        owner: _Owner,
        seq: int,
        name: str,
        fn: Callable[[], Any],
        is_coro: bool,
        reads: tuple[Var, ...],
        mutates: tuple[Var, ...],
    ) -> None:
        self.seq = seq
        self.name = name
        self._owner = owner
        self._fn: Callable[[], Any] | None = fn
        self._is_coro = is_coro
        self._reads = reads
        self._mutates = mutates
        self._status = Status.PENDING
        self._value: object = None
        self._poison: Poison | None = None
        self._inherited: dict[Var, Poison] | None = None
        self._npending = 0
        self._dependents: list[OpHandle[Any]] = []
        self._preds: list[tuple[Var, OpHandle[Any]]] = []
        self._task: asyncio.Future[Any] | None = None
        # A plain function handed to the pool: its executor future, cancellable while the
        # function waits for a free thread (the op counts as running from the hand-over).
        self._queued: concurrent.futures.Future[Any] | None = None
        self._node_done = False
        self._node_waiters: list[Countdown] | None = None
        self._outcome_waiters: list[asyncio.Future[None]] | None = None
        self._always_run = False  # run even when a var it touches is poisoned
        # Set by whoever pushed the op when cancelling must go through it (a pushed
        # collective: cancel the collective, and let the op run to hold its var until the
        # collective has ended); called instead of the engine's cancel while the op is open.
        self._cancel_hook: Callable[[], bool] | None = None
        # An always_run op started despite a poisoned var: what a cancellation before its
        # body ran passes on (as a cancelled pending op does; see graph.inherit).
        self._would_inherit: dict[Var, Poison] | None = None
        # For an always_run op that ran despite a poisoned var: the error it would have
        # failed with otherwise, so its function can act on it.
        self.blocked: BaseException | None = None
        self._t_push = 0.0

    # -- public, asyncio-like ------------------------------------------------------------

    @property
    def reads(self) -> tuple[Var, ...]:
        """Vars the op reads (without those it also mutates)."""
        return self._reads

    @property
    def mutates(self) -> tuple[Var, ...]:
        """Vars the op mutates."""
        return self._mutates

    @property
    def status(self) -> str:
        """One of "pending", "running", "succeeded", "failed", "cancelled"."""
        return self._status.value

    def done(self) -> bool:
        """Return True once the op succeeded, failed or was cancelled."""
        return self._status not in _OPEN

    def cancelled(self) -> bool:
        """Return True if the op was cancelled (before or while it ran)."""
        return self._status is Status.CANCELLED

    def cancel_through(self, hook: Callable[[], bool]) -> None:
        """Cancel this op by calling `hook` while it is open (see `cancel`): whoever
        pushed it (a collective pushed through the communicator) cancels it there."""
        self._cancel_hook = hook

    def cancel(self) -> bool:
        """Ask to cancel the op; return False when that is no longer possible.

        A pending op (or a coroutine op whose body has not started) is removed at once: it
        never runs, poisons nothing, and ops behind it wait for what it waited for. An op
        running on the event loop (a coroutine, or the awaitable a plain function
        returned) gets its task cancelled and ends cancelled once the task has unwound,
        poisoning the vars it mutates (they may be half written). A plain function
        running in a pool thread cannot be interrupted: False; one still waiting for a
        free pool thread is removed like a pending op.

        A collective pushed through the communicator (`comm.push_all_reduce`, ...) is
        cancelled as a collective is: the peers fail with `CollectiveAbortedError`, and the
        op ends cancelled once the collective has ended on this rank, poisoning its var
        (until then, later ops on that var wait, since the collective may still use it).
        """
        hook = self._cancel_hook
        if hook is not None and self._status in _OPEN:
            return hook()
        return self._owner._cancel(self)

    def result(self) -> T:
        """Return the op's result, or raise its error (CancelledError if cancelled).

        Raises:
            asyncio.InvalidStateError: the op has not finished yet.
        """
        status = self._status
        if status is Status.SUCCEEDED:
            return cast(T, self._value)
        if status is Status.FAILED:
            self._owner._observed(self)  # reported here: wait_all need not raise it again
            raise cast(BaseException, self._value)
        if status is Status.CANCELLED:
            raise asyncio.CancelledError(f"op {self.name!r} was cancelled")
        raise asyncio.InvalidStateError(f"op {self.name!r} is still {status.value}")

    def exception(self) -> BaseException | None:
        """Return the op's error (None if it succeeded); raise like `result()` otherwise."""
        if self._status is Status.FAILED:
            self._owner._observed(self)
            return cast(BaseException, self._value)
        self.result()
        return None

    def __await__(self) -> Generator[Any, None, T]:
        if self._status in _OPEN:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            if self._outcome_waiters is None:
                self._outcome_waiters = []
            self._outcome_waiters.append(future)
            yield from future.__await__()
        return self.result()

    def __repr__(self) -> str:
        reads = ", ".join(v.name for v in self._reads)
        mutates = ", ".join(v.name for v in self._mutates)
        return (
            f"<OpHandle #{self.seq} {self.name!r} {self._status.value} "
            f"read=[{reads}] mutate=[{mutates}]>"
        )

    # -- used by the engines ---------------------------------------------------------------

    def _resolve(self, status: Status, value: object) -> None:
        """Fix the outcome and wake whoever awaits the handle."""
        self._status = status
        self._value = value
        self._fn = None  # the closure may hold large arrays; drop it as soon as possible
        waiters = self._outcome_waiters
        if waiters is not None:
            self._outcome_waiters = None
            for future in waiters:
                if not future.done():
                    future.set_result(None)

    def _poison_for(self, var: Var) -> Poison | None:
        """What this finished op leaves on `var` (one it mutates): a poison or None."""
        if self._inherited is not None:
            return self._inherited.get(var)
        return self._poison
