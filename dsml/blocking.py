"""The blocking API: dsml's collectives for synchronous code (adapter layer).

    import dsml.blocking, numpy as np

    with dsml.blocking.init() as comm:          # same arguments as dsml.init
        x = np.ones(4)
        comm.all_reduce(x)                      # blocks; x is reduced in place
        h = comm.all_reduce(y, async_op=True)   # starts now; h.wait() / h.done()

Each blocking communicator owns an asyncio event loop running on a background thread;
the async `Communicator` lives there, and every call here hands its work to that loop
and, unless `async_op=True`, waits for the result. Calls made in the same order on every
rank match each other, as with the async API. Ctrl-C while a call waits cancels that
collective (the peers fail with `CollectiveAbortedError` instead of waiting) and raises
KeyboardInterrupt; the communicator stays usable. `close()` (or leaving `with`) closes the
communicator and joins the thread. The dependency engine is reachable as `comm.engine`.

Nothing here imports torch or JAX; arrays of every kind the async API takes are taken.
The loop thread and the `Handle` of an operation started on it live in blocking_loop.py
(re-exported here); this module holds the communicator and engine that block on them.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Iterable, Sequence
from os import PathLike
from types import TracebackType
from typing import Any, TypeVar

from .blocking_loop import Handle, LoopThread
from .collectives.cost import Choice
from .communicator import Communicator
from .communicator import init as async_init
from .communicator.view_changes import ViewListener
from .engine import Engine, Tagged, Var
from .errors import ConfigError, RegistryUnavailableError
from .membership import View

__all__ = ["BlockingCommunicator", "BlockingEngine", "Handle", "LoopThread", "init"]

T = TypeVar("T")
Array = Any


class BlockingCommunicator:
    """A communicator whose calls block (see the module docstring). Make with `init`."""

    def __init__(self, comm: Communicator, loop: LoopThread, *, owns_loop: bool = True) -> None:
        self._comm = comm
        self._loop = loop
        self._owns_loop = owns_loop  # a sub-communicator shares its parent's loop
        self._engine: BlockingEngine | None = None
        self._closed = False

    # -- identity ---------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def world_size(self) -> int:
        return self._comm.world_size

    @property
    def epoch(self) -> int:
        return self._comm.epoch

    @property
    def view(self) -> View:
        return self._comm.view

    @property
    def device(self) -> str:
        return self._comm.device

    @property
    def async_comm(self) -> Communicator:
        """The async communicator underneath (use it from `loop` only)."""
        return self._comm

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the communicator runs on (on its own thread)."""
        return self._loop.loop

    def statistics(self) -> dict[str, int]:
        self._check_open("statistics")
        return self._loop.call(self._comm.statistics)

    def stats(self) -> list[dict[str, Any]]:
        """This rank's recent calls (see `Communicator.stats`)."""
        self._check_open("stats")
        return self._loop.call(self._comm.stats)

    def trace(self) -> dict[str, Any]:
        """The recent calls as a Chrome trace (see `Communicator.trace`)."""
        self._check_open("trace")
        return self._loop.call(self._comm.trace)

    def write_trace(self, path: str | PathLike[str]) -> None:
        """Write `trace()` as JSON to path."""
        self._check_open("write_trace")
        self._loop.call(lambda: self._comm.write_trace(path))

    def all_reduce_choice(self, nbytes: int) -> Choice:
        """What `auto` would run for an all_reduce of nbytes (see the async method)."""
        self._check_open("all_reduce_choice")
        return self._loop.call(lambda: self._comm.all_reduce_choice(nbytes))

    def on_view_change(self, callback: ViewListener) -> Callable[[], None]:
        """Call callback(old, new) at each new view; returns the function that removes it.
        The callback runs on the communicator's loop thread, not the caller's."""
        self._check_open("on_view_change")
        remove = self._loop.call(lambda: self._comm.on_view_change(callback))
        return lambda: self._loop.call(remove)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ConfigError(f"{what}: this communicator is closed")

    def wait_view_change(self, timeout: float | None = None) -> View:
        """Block until the registry announces a newer view; return it."""
        self._check_open("wait_view_change")
        return self._loop.run(self._comm.wait_view_change(timeout), "wait_view_change")

    # -- collectives ------------------------------------------------------------------------
    # Each returns the async method's result (x itself for in-place calls), or with
    # async_op=True a Handle whose wait() gives it.

    def all_reduce(
        self,
        x: Array,
        op: Any = "sum",
        *,
        algorithm: str = "auto",
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Reduce x over all ranks, in place on every rank; returns x (see `dsml.init`)."""
        return self._issue(
            "all_reduce",
            lambda c: c.all_reduce(x, op, algorithm=algorithm, timeout=timeout),
            async_op,
        )

    def reduce(
        self,
        x: Array,
        root: int = 0,
        op: Any = "sum",
        *,
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Reduce x onto root (in place there); other ranks get None and keep x."""
        return self._issue("reduce", lambda c: c.reduce(x, root, op, timeout=timeout), async_op)

    def broadcast(
        self, x: Array, root: int = 0, *, timeout: float | None = None, async_op: bool = False
    ) -> Any:
        """Copy root's x into every rank's x; returns x."""
        return self._issue("broadcast", lambda c: c.broadcast(x, root, timeout=timeout), async_op)

    def all_gather(self, x: Array, *, timeout: float | None = None, async_op: bool = False) -> Any:
        """Every rank's x concatenated along axis 0 in rank order (a new array)."""
        return self._issue("all_gather", lambda c: c.all_gather(x, timeout=timeout), async_op)

    def gather(
        self, x: Array, root: int = 0, *, timeout: float | None = None, async_op: bool = False
    ) -> Any:
        """Like all_gather, but only root gets the result; others get None."""
        return self._issue("gather", lambda c: c.gather(x, root, timeout=timeout), async_op)

    def scatter(
        self,
        x: Array | None = None,
        root: int = 0,
        *,
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Rank r receives numpy.array_split(root's x, world_size)[r]; non-roots pass None."""
        return self._issue("scatter", lambda c: c.scatter(x, root, timeout=timeout), async_op)

    def reduce_scatter(
        self, x: Array, op: Any = "sum", *, timeout: float | None = None, async_op: bool = False
    ) -> Any:
        """Rank r receives the reduction of numpy.array_split(x, world_size)[r]."""
        return self._issue(
            "reduce_scatter", lambda c: c.reduce_scatter(x, op, timeout=timeout), async_op
        )

    def all_to_all(self, x: Array, *, timeout: float | None = None, async_op: bool = False) -> Any:
        """Part j of numpy.array_split(x, world_size) goes to rank j; parts received are
        concatenated in rank order."""
        return self._issue("all_to_all", lambda c: c.all_to_all(x, timeout=timeout), async_op)

    def barrier(self, *, timeout: float | None = None, async_op: bool = False) -> Any:
        """Return once every rank has entered the barrier."""
        return self._issue("barrier", lambda c: c.barrier(timeout=timeout), async_op)

    def send(
        self,
        x: Array,
        dst: int,
        *,
        tag: int = 0,
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Send x to rank dst; returns once x may be modified again."""
        return self._issue("send", lambda c: c.send(x, dst, tag=tag, timeout=timeout), async_op)

    def recv(
        self, src: int, *, tag: int = 0, timeout: float | None = None, async_op: bool = False
    ) -> Any:
        """Receive the next array rank src sent with this tag (a new numpy or cupy array)."""
        return self._issue("recv", lambda c: c.recv(src, tag=tag, timeout=timeout), async_op)

    def _issue(
        self, what: str, start: Callable[[Communicator], Awaitable[Any]], async_op: bool
    ) -> Any:
        if self._closed:
            raise ConfigError(f"{what}: this communicator is closed")
        # Started from this thread: the communicator hands the start to its loop and
        # returns once the call has its collective id (program order), raising bad
        # arguments here; the result is then awaited on the loop.
        if _foreign_loop_running(self._loop.loop):
            # A thread with an event loop of its own running (a Jupyter cell, a coroutine):
            # the communicator refuses calls from a foreign loop, so the start itself is
            # handed over, with this thread's context (an engine op's mark) as on_loop does.
            context = contextvars.copy_context()
            started = self._loop.call(lambda: context.run(start, self._comm))
            handle = self._loop.start(started, what)
        else:
            handle = self._loop.start(start(self._comm), what)
        return handle if async_op else handle.wait()

    # -- sub-communicators ------------------------------------------------------------------
    # Collectives: every rank calls them, blocking (no async_op). The sub-communicators
    # share this one's loop thread; closing one leaves the group it made, not the thread.

    def split(
        self, color: int | None, key: int | None = None, *, timeout: float | None = None
    ) -> BlockingCommunicator | None:
        """Split the group, one sub-communicator per colour (see `Communicator.split`)."""
        self._check_open("split")
        sub = self._loop.run(self._comm.split(color, key, timeout=timeout), "split")
        return None if sub is None else BlockingCommunicator(sub, self._loop, owns_loop=False)

    def new_group(
        self, ranks: Sequence[int], *, timeout: float | None = None
    ) -> BlockingCommunicator | None:
        """A sub-communicator of `ranks`; None on other ranks (see `Communicator.new_group`)."""
        self._check_open("new_group")
        sub = self._loop.run(self._comm.new_group(ranks, timeout=timeout), "new_group")
        return None if sub is None else BlockingCommunicator(sub, self._loop, owns_loop=False)

    # -- the dependency engine --------------------------------------------------------------

    @property
    def engine(self) -> BlockingEngine:
        """This rank's dependency engine, driven from this thread."""
        if self._engine is None:
            self._check_open("engine")
            self._engine = BlockingEngine(self._loop.call(lambda: self._comm.engine), self)
        return self._engine

    @property
    def var(self) -> Var:
        """The var that orders collectives pushed through the engine."""
        self._check_open("var")
        return self._loop.call(lambda: self._comm.var)

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Leave the group, close the communicator and join the loop's thread."""
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.run(self._comm.aclose(), "close")
        finally:
            if self._owns_loop:
                self._loop.stop()

    def __enter__(self) -> BlockingCommunicator:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.run(self._comm.__aexit__(exc_type, exc, tb), "close")
        finally:
            if self._owns_loop:
                self._loop.stop()

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<BlockingCommunicator {self._comm!r}{state}>"


def _foreign_loop_running(ours: asyncio.AbstractEventLoop) -> bool:
    """Does this thread run an event loop other than the communicator's own?"""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        return False
    return running is not ours


class BlockingEngine:
    """The communicator's dependency engine, used from a synchronous thread.

    `push` returns a `Handle`; `wait_var` and `wait_all` block. Functions pushed run as
    with the async engine: plain ones on the engine's thread pool, coroutine functions on
    the communicator's loop.
    """

    def __init__(self, engine: Engine, comm: BlockingCommunicator) -> None:
        self._engine = engine
        self._comm = comm

    @property
    def _loop(self) -> LoopThread:
        if self._comm._closed:  # its loop is gone: say so, not "Event loop is closed"
            raise ConfigError("this communicator is closed: its engine is closed too")
        return self._comm._loop

    def new_var(self, name: str) -> Var:
        return self._loop.call(lambda: self._engine.new_var(name))

    def tag(self, name: str, data: T) -> Tagged[T]:
        return self._loop.call(lambda: self._engine.tag(name, data))

    def push(
        self,
        fn: Callable[[], Any],
        read: Iterable[Var] = (),
        mutate: Iterable[Var] = (),
        name: str | None = None,
        *,
        always_run: bool = False,
    ) -> Handle[Any]:
        """Schedule `fn` after the ops it depends on (see `dsml.Engine.push`).

        Cancelling the handle (or Ctrl-C while waiting on it) cancels the op in the
        engine, as `OpHandle.cancel` does, not only the wait.
        """
        op = self._loop.call(
            lambda: self._engine.push(fn, read, mutate, name, always_run=always_run)
        )
        return self._loop.start(op, f"engine op {op.name!r}", op.cancel)

    def push_all_reduce(
        self, tagged: Tagged[Array], op: Any = "sum", *, read: Iterable[Var] = (), **options: Any
    ) -> Handle[Any]:
        """Push an all_reduce of `tagged.data` (see `Communicator.push_all_reduce`);
        cancelling the handle cancels the collective on every rank."""
        comm = self._comm.async_comm
        pushed = self._loop.call(lambda: comm.push_all_reduce(tagged, op, read=read, **options))
        return self._loop.start(pushed, f"all_reduce({tagged.var.name})", pushed.cancel)

    def push_broadcast(
        self, tagged: Tagged[Array], root: int = 0, *, timeout: float | None = None
    ) -> Handle[Any]:
        """Push a broadcast of `tagged.data` (see `Communicator.push_broadcast`)."""
        comm = self._comm.async_comm
        pushed = self._loop.call(lambda: comm.push_broadcast(tagged, root, timeout=timeout))
        return self._loop.start(pushed, f"broadcast({tagged.var.name})", pushed.cancel)

    def clear_error(self, var: Var) -> None:
        """Clear `var`'s poison for the ops pushed after this call (`Engine.clear_error`)."""
        self._loop.call(lambda: self._engine.clear_error(var))

    def wait_var(self, var: Var) -> None:
        """Block until every op pushed so far that touches `var` has finished."""
        loop = self._loop
        loop.run(self._engine.wait_var(var), f"wait_var({getattr(var, 'name', var)!r})")

    def wait_all(self) -> None:
        """Block until every op pushed so far has finished."""
        self._loop.run(self._engine.wait_all(), "wait_all")

    def __repr__(self) -> str:
        return f"<BlockingEngine {self._engine!r}>"


def init(
    address: str | None = None,
    world_size: int | None = None,
    **options: Any,
) -> BlockingCommunicator:
    """Join a group and return a blocking communicator (arguments as for `dsml.init`).

    Use `with dsml.blocking.init(...) as comm:` or call `comm.close()` when done.

    Raises:
        DsmlError: as `dsml.init` raises them (`ConfigError`, `RegistryUnavailableError`,
            `JoinTimeoutError`).
        KeyboardInterrupt: Ctrl-C while joining gives the join up.
    """
    loop = LoopThread()

    async def join() -> Communicator:
        return await async_init(address, world_size, **options)

    blocked = _foreign_loop_running(loop.loop)  # this thread's own loop waits meanwhile
    try:
        comm = loop.run(join(), "init")
    except BaseException as exc:
        loop.stop()
        if blocked and isinstance(exc, RegistryUnavailableError):
            raise RegistryUnavailableError(
                f"{exc} (this thread's event loop was blocked while it waited: a registry "
                "served from that loop, as after `await dsml.open_registry()` in a notebook, "
                "cannot answer; use `await dsml.init(...)` there)"
            ) from exc
        raise
    return BlockingCommunicator(comm, loop)
