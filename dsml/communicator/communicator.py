"""The user-facing communicator: collectives and point-to-point (communicator layer).

Each method validates its arguments on this rank, takes the next collective id (program
order is collective order), and starts the operation at once as a task; it returns a
`CollectiveHandle` to await. The runner gives every call its timeout, turns a peer's abort
into this rank's error, aborts the peers when this rank fails or is cancelled, and asks
the peers where they are before reporting a timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar

from ..config import CommConfig
from ..errors import (
    CollectiveError,
    CollectiveTimeoutError,
    ConfigError,
    DsmlError,
    ProtocolError,
)
from ..membership import RegistryClient, View
from ..wire import Fingerprint
from .call import Call
from .diagnose import timeout_message
from .handle import CollectiveHandle
from .mesh import Mesh
from .p2p import PointToPoint
from .plans import Plan, Planner, loose_fingerprint

__all__ = ["Communicator"]

T = TypeVar("T")
Array = Any


class Communicator:
    """A member of a group. Create with `dsml.init`; close with `aclose()`."""

    def __init__(
        self,
        mesh: Mesh,
        registry: RegistryClient,
        config: CommConfig,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.config = config
        self._mesh = mesh
        self._registry = registry
        self._loop = loop
        self._planner = Planner()
        self._p2p = PointToPoint(mesh)
        self._closed = False

    # -- identity ---------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This worker's rank in the current view (0..world_size-1)."""
        return self._mesh.rank

    @property
    def world_size(self) -> int:
        return self._mesh.size

    @property
    def epoch(self) -> int:
        """The epoch of the current view; it grows with every change of membership."""
        return self._mesh.epoch

    @property
    def view(self) -> View:
        assert self._mesh.view is not None
        return self._mesh.view

    @property
    def address(self) -> str:
        """The address this worker's endpoint serves on."""
        return self.view.members[self.rank].address

    @property
    def registry_address(self) -> str:
        return self._registry.address

    @property
    def device(self) -> str:
        return "cpu"

    def statistics(self) -> dict[str, int]:
        """Counters of the data plane: messages dropped as malformed, of an older epoch
        (stale), for a finished call (late), held for a view not seen yet; calls in flight."""
        return {
            "dropped": self._mesh.dropped,
            "stale": self._mesh.counters["stale"],
            "late": self._mesh.counters["late"],
            "held": self._mesh.counters["held"],
            "in_flight": len(self._mesh.calls),
            "next_cid": self._mesh.next_cid,
        }

    # -- collectives ------------------------------------------------------------------------

    def all_reduce(
        self, x: Array, op: Any = "sum", *, algorithm: str = "auto", timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Reduce x over all ranks, in place on every rank; the handle gives x."""
        return self._start(
            lambda: self._planner.all_reduce(x, op, algorithm, self.world_size),
            lambda: loose_fingerprint("all_reduce", x, op),
            timeout,
        )

    def reduce(
        self, x: Array, root: int = 0, op: Any = "sum", *, timeout: float | None = None
    ) -> CollectiveHandle[Array | None]:
        """Reduce x onto root (in place there); other ranks get None and keep x."""
        return self._start(
            lambda: self._planner.reduce(x, root, op, self.rank, self.world_size),
            lambda: loose_fingerprint("reduce", x, op, root),
            timeout,
        )

    def broadcast(
        self, x: Array, root: int = 0, *, timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Copy root's x into every rank's x (same shape and dtype); the handle gives x."""
        return self._start(
            lambda: self._planner.broadcast(x, root, self.rank, self.world_size),
            lambda: loose_fingerprint("broadcast", x, None, root),
            timeout,
        )

    def all_gather(self, x: Array, *, timeout: float | None = None) -> CollectiveHandle[Array]:
        """Every rank's x concatenated along axis 0 in rank order (a new array)."""
        return self._start(
            lambda: self._planner.all_gather(x),
            lambda: loose_fingerprint("all_gather", x),
            timeout,
        )

    def gather(
        self, x: Array, root: int = 0, *, timeout: float | None = None
    ) -> CollectiveHandle[Array | None]:
        """Like all_gather, but only root gets the result; others get None."""
        return self._start(
            lambda: self._planner.gather(x, root, self.world_size),
            lambda: loose_fingerprint("gather", x, None, root),
            timeout,
        )

    def scatter(
        self, x: Array | None = None, root: int = 0, *, timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Rank r receives numpy.array_split(root's x, world_size)[r]; non-roots pass None."""
        return self._start(
            lambda: self._planner.scatter(x, root, self.rank, self.world_size),
            lambda: loose_fingerprint("scatter", x, None, root),
            timeout,
        )

    def reduce_scatter(
        self, x: Array, op: Any = "sum", *, timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Rank r receives the reduction of numpy.array_split(x, world_size)[r]."""
        return self._start(
            lambda: self._planner.reduce_scatter(x, op),
            lambda: loose_fingerprint("reduce_scatter", x, op),
            timeout,
        )

    def all_to_all(self, x: Array, *, timeout: float | None = None) -> CollectiveHandle[Array]:
        """Part j of numpy.array_split(x, world_size) goes to rank j; parts received are
        concatenated in rank order."""
        return self._start(
            lambda: self._planner.all_to_all(x),
            lambda: loose_fingerprint("all_to_all", x),
            timeout,
        )

    def barrier(self, *, timeout: float | None = None) -> CollectiveHandle[None]:
        """Return once every rank has entered the barrier."""
        return self._start(self._planner.barrier, lambda: Fingerprint("barrier"), timeout)

    # -- point to point ---------------------------------------------------------------------

    def send(
        self, x: Array, dst: int, *, tag: int = 0, timeout: float | None = None
    ) -> CollectiveHandle[None]:
        """Send x to rank dst; ordered per (source, destination, tag).

        The handle completes once x may be modified again (not when dst has received it).
        """

        def start() -> CollectiveHandle[None]:
            budget = self._budget(timeout)
            _fp, send = self._p2p.plan_send(x, dst, tag)
            what = f"send to rank {dst} (tag {tag})"
            hint = f"is rank {dst} alive and connected?"
            task = self._loop.create_task(self._run_p2p(send, budget, what, hint, [dst]))
            return CollectiveHandle(task, "send", 0)

        return self._on_loop(start)

    def recv(
        self, src: int, *, tag: int = 0, timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Receive the next array rank src sent with this tag (a new array)."""

        def start() -> CollectiveHandle[Array]:
            budget = self._budget(timeout)
            peer, tag_ = self._p2p.plan_recv(src, tag)
            call = Call(self._mesh, 0, Fingerprint("recv", root=tag_), budget, peer=peer)
            what = f"recv from rank {peer} (tag {tag_})"
            hint = (
                f"rank {peer} has not sent it: check that it calls send(x, {self.rank}, tag={tag_})"
            )

            def receive() -> Awaitable[Array]:
                return self._p2p.receive(peer, tag_)

            task = self._loop.create_task(self._run_p2p(receive, budget, what, hint, [peer], call))
            call.task = task
            self._mesh.receives.add(call)
            task.add_done_callback(lambda _t: self._mesh.receives.discard(call))
            return CollectiveHandle(task, "recv", 0)

        return self._on_loop(start)

    async def _run_p2p(
        self,
        make: Callable[[], Awaitable[T]],
        budget: float,
        what: str,
        hint: str,
        peers: list[int],
        call: Call | None = None,
    ) -> T:
        try:
            if call is not None:
                call.running = True
                if call.failure is not None:
                    raise call.failure
            async with asyncio.timeout(budget):
                return await make()
        except asyncio.CancelledError:
            if call is None or call.failure is None:
                raise
            self._uncancel()
            raise call.failure from None
        except TimeoutError as exc:
            if isinstance(exc, DsmlError):
                raise
            raise CollectiveTimeoutError(
                f"{what} timed out after {budget:g} s on rank {self.rank}: {hint}",
                missing=peers,
                rank=self.rank,
                epoch=self.epoch,
            ) from None

    # -- running calls ----------------------------------------------------------------------

    def _budget(self, timeout: float | None) -> float:
        budget = self.config.timeout if timeout is None else timeout
        if not isinstance(budget, int | float) or not math.isfinite(budget) or budget <= 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        return float(budget)

    def _on_loop(self, start: Callable[[], CollectiveHandle[T]]) -> CollectiveHandle[T]:
        """Run start() on this communicator's loop, also when called from another thread."""
        if self._closed:
            raise ConfigError("this communicator is closed")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            return start()
        if running is not None:
            raise ConfigError("this communicator belongs to another event loop")
        done: concurrent.futures.Future[CollectiveHandle[T]] = concurrent.futures.Future()

        def call() -> None:
            try:
                done.set_result(start())
            except BaseException as exc:  # handed to the calling thread
                done.set_exception(exc)

        self._loop.call_soon_threadsafe(call)
        return done.result()

    def _start(
        self,
        plan: Callable[[], Plan],
        loose: Callable[[], Fingerprint],
        timeout: float | None,
    ) -> CollectiveHandle[Any]:
        def start() -> CollectiveHandle[Any]:
            cid = self._mesh.next_cid
            self._mesh.next_cid += 1
            try:
                budget = self._budget(timeout)
                planned = plan()
            except ConfigError as exc:
                rejected = Call(self._mesh, cid, loose(), self.config.timeout)
                reason = f"rank {self.rank} rejected its arguments: {exc}"
                self._mesh.abort(rejected, "invalid", reason)
                raise
            call = Call(self._mesh, cid, planned.fingerprint, budget)
            self._mesh.register(call)
            task = self._loop.create_task(self._run(call, planned))
            call.task = task
            task.add_done_callback(lambda t: self._finished(call, t))
            return CollectiveHandle(task, planned.fingerprint.collective, cid)

        return self._on_loop(start)

    async def _run(self, call: Call, plan: Plan) -> Any:
        call.running = True
        try:
            error = call.failure or self._mesh.check_start(call)
            if error is not None:
                call.failure = error  # already known to the peers: no abort from here
                raise error
            async with asyncio.timeout(call.timeout):
                return await plan.body(call)
        except asyncio.CancelledError:
            if call.failure is None:
                raise  # cancelled by the caller; _finished aborts the peers
            self._uncancel()
            raise call.failure from None
        except TimeoutError as exc:
            if isinstance(exc, CollectiveError):
                raise
            raise await self._timed_out(call) from None
        except (ProtocolError, CollectiveError) as exc:
            if call.failure is None:
                call.failure = exc
                self._mesh.abort(call, "failed", f"rank {self.rank} failed: {exc}")
            raise

    async def _timed_out(self, call: Call) -> CollectiveTimeoutError:
        call.running = False  # peers' probes and aborts must not cancel the diagnosis
        progress = await self._mesh.probe(call)
        message, missing = timeout_message(
            call.cid, call.fingerprint, self.rank, call.timeout, progress
        )
        call.failure = CollectiveTimeoutError(
            message,
            missing=missing,
            rank=self.rank,
            epoch=call.epoch,
            cid=call.cid,
            collective=call.fingerprint.collective,
        )
        self._mesh.abort(call, "timeout", message, missing)
        return call.failure

    def _finished(self, call: Call, task: asyncio.Task[Any]) -> None:
        self._mesh.finish(call)
        if task.cancelled() and call.failure is None:
            self._mesh.abort(call, "cancelled", f"rank {self.rank} cancelled the call")
        elif not task.cancelled() and call.failure is None and task.exception() is not None:
            self._mesh.abort(call, "failed", f"rank {self.rank} failed: {task.exception()!r}")

    @staticmethod
    def _uncancel() -> None:
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()

    # -- lifecycle --------------------------------------------------------------------------

    async def aclose(self, *, error: BaseException | None = None) -> None:
        """Cancel calls in flight, say goodbye to the peers, leave the group, close sockets.

        `error` (set when `async with` exits by an exception) tells the peers why this rank
        left, so their pending and later calls fail naming it instead of waiting.
        """
        if self._closed:
            return
        calls = [c.task for c in self._mesh.calls.values() if c.task is not None]
        calls += [r.task for r in self._mesh.receives if r.task is not None]
        for task in calls:
            task.cancel()
        if calls:
            await asyncio.wait(calls, timeout=2.0)
        self._closed = True
        reason = f"{type(error).__name__}: {error}" if error is not None else None
        await self._mesh.aclose(reason)
        try:
            await self._registry.leave()
        finally:
            await self._registry.aclose()

    async def __aenter__(self) -> Communicator:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose(error=exc if isinstance(exc, Exception) else None)

    def __repr__(self) -> str:
        if self._mesh.view is None:
            return "<Communicator (not joined)>"
        state = " closed" if self._closed else ""
        return (
            f"<Communicator rank={self.rank}/{self.world_size} epoch={self.epoch} "
            f"address={self.address} in_flight={len(self._mesh.calls)}{state}>"
        )
