"""The user-facing communicator: collectives, point-to-point, its engine (communicator).

Each method validates its arguments on this rank, takes the next collective id (program
order is collective order), and starts the operation at once (see `runner.py`); it returns
a `CollectiveHandle` to await. `comm.engine` and `comm.var` connect the dependency engine:
collectives pushed with `comm.var` among their mutated vars are issued in push order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from types import TracebackType
from typing import Any, TypeVar

from ..collectives.cost import Choice, CostModel
from ..collectives.cost_auto import AutoChooser
from ..config import CommConfig
from ..engine import Engine, OpHandle, Tagged, Var
from ..membership import RegistryClient, View
from ..wire import Fingerprint
from .call import Call
from .engine_link import EngineLink
from .handle import CollectiveHandle
from .mesh import Mesh
from .p2p import PointToPoint
from .placement import Placement
from .plans import Plan, Planner, loose_fingerprint
from .runner import Runner
from .views import ViewKeeper, ViewListener

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
        device: str = "cpu",
    ) -> None:
        self.config = config
        self._mesh = mesh
        self._registry = registry
        self._keeper = ViewKeeper(mesh, registry, config.view_timeout)
        self._runner = Runner(mesh, self._keeper, config, loop)
        self._placement = Placement(device, config.gpu_reduce, config.chunk_bytes)
        self._auto = AutoChooser(
            lambda: mesh.epoch,
            lambda: host_keys(mesh.view),
            default_chunk_bytes=config.chunk_bytes,
            max_chunk_bytes=config.max_frame_bytes,
        )
        self._planner = Planner(config.chunk_bytes, self._placement, self._auto)
        self._p2p = PointToPoint(mesh, self._placement)
        self._keeper.listeners.append(lambda _old, _new: self._p2p.reset())
        self._link = EngineLink(
            self._runner, lambda: (self.rank, self.epoch), trace=config.engine_trace
        )
        registry.attach(self._keeper)
        registry.start_heartbeats(self._progress)

    def _progress(self) -> dict[str, Any]:
        """A heartbeat's body (read from the heartbeat thread: plain attribute reads)."""
        started, finished = self._mesh.started, self._mesh.finished
        return {
            "epoch": self._mesh.epoch,
            "started": list(started) if started is not None else None,
            "finished": list(finished) if finished is not None else None,
        }

    # -- identity ---------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This worker's rank in the view its next collective runs in (0..world_size-1)."""
        view = self.view
        rank = view.rank_of(self._mesh.member_id)
        return rank if rank is not None else self._mesh.rank

    @property
    def world_size(self) -> int:
        """Members of the view the next collective runs in."""
        return self.view.size

    @property
    def epoch(self) -> int:
        """The epoch of that view; it grows with every change of membership."""
        return self.view.epoch

    @property
    def view(self) -> View:
        """The view (epoch, members in ring order) the next collective runs in, as far as
        this rank knows; after a member was lost, the survivors' view once it is known."""
        return self._keeper.next_view()

    @property
    def member_id(self) -> str:
        return self._mesh.member_id

    @property
    def address(self) -> str:
        """The address this worker's endpoint serves on."""
        assert self._mesh.view is not None
        return self._mesh.view.members[self._mesh.rank].address

    @property
    def evicted(self) -> bool:
        """Whether the registry declared this worker dead; it must join again."""
        return self._keeper.evicted

    @property
    def interrupt_on_join(self) -> bool:
        """When true, the first collective after members joined raises
        `MembershipChangedError` instead of running, so the application can bring the
        joiners up to date first (`dsml.elastic.run` sets it)."""
        return self._keeper.interrupt_on_join

    @interrupt_on_join.setter
    def interrupt_on_join(self, value: bool) -> None:
        self._keeper.interrupt_on_join = bool(value)

    def on_view_change(self, callback: ViewListener) -> Callable[[], None]:
        """Call `callback(old_view, new_view)` each time this rank switches views (on the
        loop, at a collective boundary); returns a function that removes it."""
        self._keeper.listeners.append(callback)
        return lambda: self._keeper.listeners.remove(callback)

    async def wait_view_change(self, timeout: float | None = None) -> View:  # noqa: ASYNC109
        """Wait until the registry announces a view newer than the current one (a member
        lost, left or joined); returns it. It is used from the next collective on."""
        return await self._keeper.wait_known(timeout)

    @property
    def registry_address(self) -> str:
        return self._registry.address

    @property
    def device(self) -> str:
        """ "cpu" or "cuda:N": where arrays this communicator creates without an input go
        (`recv`, `scatter` on non-roots). Collectives on an array work on its own device."""
        return self._placement.device

    @property
    def cost_model(self) -> CostModel | None:
        """The cost model measured on this view, which `auto` chooses from (docs/auto.md).

        None on a single host (a measured size table decides there) and, across hosts,
        until the view's first `auto` all_reduce has measured it.
        """
        return self._auto.model

    def all_reduce_choice(self, nbytes: int) -> Choice:
        """What `all_reduce(algorithm="auto")` runs now for an array of nbytes."""
        return self._auto.choice(nbytes, self._mesh.size)

    def statistics(self) -> dict[str, int]:
        """Counters of the data plane: messages dropped as malformed, of an older epoch
        (stale), for a finished call (late), held for a view not seen yet; calls in flight."""
        return {
            "dropped": self._mesh.dropped,
            "stale": self._mesh.counters["stale"],
            "late": self._mesh.counters["late"],
            "held": self._mesh.counters["held"],
            "disconnects": self._mesh.counters["disconnects"],
            "views_installed": self._keeper.installed,
            "in_flight": len(self._mesh.calls),
            "next_cid": self._mesh.next_cid,
        }

    # -- collectives ------------------------------------------------------------------------

    def all_reduce(
        self, x: Array, op: Any = "sum", *, algorithm: str = "auto", timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Reduce x over all ranks, in place on every rank; the handle gives x."""
        return self._collective(
            lambda caller: self._planner.all_reduce(x, op, algorithm, self._mesh.size, caller),
            lambda: loose_fingerprint("all_reduce", x, op),
            timeout,
            x,
        )

    def reduce(
        self, x: Array, root: int = 0, op: Any = "sum", *, timeout: float | None = None
    ) -> CollectiveHandle[Array | None]:
        """Reduce x onto root (in place there); other ranks get None and keep x."""
        return self._collective(
            lambda caller: self._planner.reduce(
                x, root, op, self._mesh.rank, self._mesh.size, caller
            ),
            lambda: loose_fingerprint("reduce", x, op, root),
            timeout,
            x,
        )

    def broadcast(
        self, x: Array, root: int = 0, *, timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Copy root's x into every rank's x (same shape and dtype); the handle gives x."""
        return self._collective(
            lambda caller: self._planner.broadcast(
                x, root, self._mesh.rank, self._mesh.size, caller
            ),
            lambda: loose_fingerprint("broadcast", x, None, root),
            timeout,
            x,
        )

    def all_gather(self, x: Array, *, timeout: float | None = None) -> CollectiveHandle[Array]:
        """Every rank's x concatenated along axis 0 in rank order (a new array)."""
        return self._collective(
            lambda caller: self._planner.all_gather(x, caller),
            lambda: loose_fingerprint("all_gather", x),
            timeout,
            x,
        )

    def gather(
        self, x: Array, root: int = 0, *, timeout: float | None = None
    ) -> CollectiveHandle[Array | None]:
        """Like all_gather, but only root gets the result; others get None."""
        return self._collective(
            lambda caller: self._planner.gather(x, root, self._mesh.size, caller),
            lambda: loose_fingerprint("gather", x, None, root),
            timeout,
            x,
        )

    def scatter(
        self, x: Array | None = None, root: int = 0, *, timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Rank r receives numpy.array_split(root's x, world_size)[r]; non-roots pass None."""
        return self._collective(
            lambda caller: self._planner.scatter(x, root, self._mesh.rank, self._mesh.size, caller),
            lambda: loose_fingerprint("scatter", x, None, root),
            timeout,
            x,
        )

    def reduce_scatter(
        self, x: Array, op: Any = "sum", *, timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Rank r receives the reduction of numpy.array_split(x, world_size)[r]."""
        return self._collective(
            lambda caller: self._planner.reduce_scatter(x, op, caller),
            lambda: loose_fingerprint("reduce_scatter", x, op),
            timeout,
            x,
        )

    def all_to_all(self, x: Array, *, timeout: float | None = None) -> CollectiveHandle[Array]:
        """Part j of numpy.array_split(x, world_size) goes to rank j; parts received are
        concatenated in rank order."""
        return self._collective(
            lambda caller: self._planner.all_to_all(x, caller),
            lambda: loose_fingerprint("all_to_all", x),
            timeout,
            x,
        )

    def barrier(self, *, timeout: float | None = None) -> CollectiveHandle[None]:
        """Return once every rank has entered the barrier."""
        return self._collective(
            lambda _caller: self._planner.barrier(), lambda: Fingerprint("barrier"), timeout
        )

    def _collective(
        self,
        plan: Callable[[Any], Plan],
        loose: Callable[[], Fingerprint],
        timeout: float | None,
        x: object = None,
    ) -> CollectiveHandle[Any]:
        caller = self._placement.caller_stream(x)  # in the caller's thread (CUDA streams)

        def planned() -> Plan:
            return plan(caller)

        def start() -> CollectiveHandle[Any]:
            if self._link.must_queue():
                return self._link.queue(planned, loose, timeout)
            return self._runner.collective(planned, loose, timeout)

        return self._runner.on_loop(start)

    # -- point to point ---------------------------------------------------------------------

    def send(
        self, x: Array, dst: int, *, tag: int = 0, timeout: float | None = None
    ) -> CollectiveHandle[None]:
        """Send x to rank dst; ordered per (source, destination, tag).

        The handle completes once x may be modified again (not when dst has received it).
        """

        caller = self._placement.caller_stream(x)

        def start() -> CollectiveHandle[None]:
            self._keeper.ensure_current()
            budget = self._runner.budget(timeout)
            _fp, send = self._p2p.plan_send(x, dst, tag, caller)
            what = f"send to rank {dst} (tag {tag})"
            hint = f"is rank {dst} alive and connected?"
            return CollectiveHandle(self._runner.p2p(send, budget, what, hint, dst), "send", 0)

        return self._runner.on_loop(start)

    def recv(
        self, src: int, *, tag: int = 0, timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Receive the next array rank src sent with this tag (a new array on comm.device)."""

        def start() -> CollectiveHandle[Array]:
            self._keeper.ensure_current()
            budget = self._runner.budget(timeout)
            peer, tag_ = self._p2p.plan_recv(src, tag)
            call = Call(self._mesh, 0, Fingerprint("recv"), budget, peer=peer, tag=tag_)
            what = f"recv from rank {peer} (tag {tag_})"
            hint = (
                f"rank {peer} has not sent it: check that it calls send(x, {self.rank}, tag={tag_})"
            )

            def receive() -> Awaitable[Array]:
                return self._p2p.receive(peer, tag_)

            task = self._runner.p2p(receive, budget, what, hint, peer, call)
            return CollectiveHandle(task, "recv", 0)

        return self._runner.on_loop(start)

    # -- the dependency engine --------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """This rank's dependency engine (created on first use, closed with the communicator)."""
        return self._link.engine

    @property
    def var(self) -> Var:
        """The var that orders collectives in the engine: push them with it in `mutate`."""
        return self._link.var

    def push_all_reduce(
        self, tagged: Tagged[Array], op: Any = "sum", *, read: Iterable[Var] = (), **options: Any
    ) -> OpHandle[Array]:
        """Push `all_reduce(tagged.data, op)` into the engine; returns the op's handle.

        Two ops are pushed. The first waits for earlier writers of `tagged.var` (and for
        `read`) and for the previous collective to be *issued* (it mutates `comm.var`), then
        starts the all_reduce; the second waits for it to finish and mutates `tagged.var`,
        so later readers of the data see the result. Collectives are thus issued in push
        order on every rank yet several can be in flight. The first op takes its turn even
        if `tagged.var` is poisoned: it then fails the collective on every rank instead of
        leaving the ranks' collective ids out of step. `options` are all_reduce's.
        """
        return self._link.push_collective(
            tagged,
            read,
            lambda: loose_fingerprint("all_reduce", tagged.data, op),
            lambda: self.all_reduce(tagged.data, op, **options),
        )

    def push_broadcast(
        self, tagged: Tagged[Array], root: int = 0, *, timeout: float | None = None
    ) -> OpHandle[Array]:
        """Push `broadcast(tagged.data, root)` into the engine (see `push_all_reduce`)."""
        return self._link.push_collective(
            tagged,
            (),
            lambda: loose_fingerprint("broadcast", tagged.data, None, root),
            lambda: self.broadcast(tagged.data, root, timeout=timeout),
        )

    # -- lifecycle --------------------------------------------------------------------------

    async def aclose(self, *, error: BaseException | None = None, cancel: bool = False) -> None:
        """Close: finish (or with `cancel`, cancel) engine ops, cancel calls in flight, say
        goodbye to the peers, leave the group, close the sockets.

        `error` (set when `async with` exits by an exception) tells the peers why this rank
        left, so their pending and later calls fail naming it instead of waiting.
        """
        if self._runner.closed:
            return
        await self._link.aclose(cancel=cancel or error is not None)
        await self._runner.cancel_all()
        reason = f"{type(error).__name__}: {error}" if error is not None else None
        last = self._mesh.next_cid - 1
        await self._mesh.aclose(reason)  # peers hear why first: the goodbye carries it
        try:
            if not self._keeper.evicted:
                await self._registry.leave(last)
        finally:
            await self._registry.aclose()

    async def _crash(self) -> None:
        """Stop as if the process had been killed: no goodbye, no leave, sockets closed
        at once, calls in flight cancelled (see `dsml.testing.crash`)."""
        if self._runner.closed:
            return
        self._registry.stop_heartbeats()
        await self._mesh.crash()
        await self._registry.aclose(linger_s=0.0)
        await self._runner.cancel_all()
        await self._link.aclose(cancel=True)

    async def __aenter__(self) -> Communicator:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        error = exc if isinstance(exc, Exception) else None
        await self.aclose(error=error, cancel=exc_type is not None)

    def __repr__(self) -> str:
        if self._mesh.view is None:
            return "<Communicator (not joined)>"
        state = " closed" if self._runner.closed else ""
        return (
            f"<Communicator rank={self.rank}/{self.world_size} epoch={self.epoch} "
            f"address={self.address} in_flight={len(self._mesh.calls)}{state}>"
        )


def host_keys(view: View | None) -> list[str]:
    """Per rank, where it runs: host name and IP (equal keys share a machine's network)."""
    if view is None:
        return []
    return [f"{m.host}/{m.address.split('://', 1)[-1].rsplit(':', 1)[0]}" for m in view.members]
