"""The user-facing communicator: collectives, point-to-point, its engine (communicator).

One class, the same for the root communicator (`dsml.init`) and its sub-groups
(`comm.split`, `comm.new_group`). It holds three parts and no other state:

- a `Session` (session.py): the links, call table, views, runner, point-to-point and
  engine link the calls run on;
- its lifecycle (`RootLife` in lifecycle.py, `SubLife` in sub_communicator.py): how it
  opens, fails as a whole and closes;
- its `Groups` (groups.py): the sub-groups split from it, closed before it.

Each collective method validates its arguments on this rank, takes the next collective id
(program order is collective order), and starts the operation at once (see `runner.py`);
it returns a `CollectiveHandle` to await. `comm.engine` and `comm.var` connect the
dependency engine: collectives pushed with `comm.var` among their mutated vars are issued
in push order.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, Sequence
from os import PathLike
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from ..collectives.cost import Choice, CostModel
from ..collectives.interop import native_arrays, with_native  # torch, JAX, DLPack, buffers
from ..engine import Engine, OpHandle, Tagged, Var
from ..membership import View
from .collective_handle import CollectiveHandle
from .groups import Groups
from .plans import Request
from .session import Session
from .view_changes import ViewListener

__all__ = ["Communicator", "Life"]

Array = Any


class Life(Protocol):
    """How a communicator closes: `RootLife` (lifecycle.py) or `SubLife`."""

    def on_close(self, fn: Callable[[], Awaitable[None]]) -> None: ...
    async def aclose(self, groups: Groups, error: BaseException | None, cancel: bool) -> None: ...
    async def crash(self, groups: Groups) -> None: ...


class Communicator:
    """A member of a group. Create with `dsml.init` (or `split` / `new_group` of one);
    close with `aclose()`."""

    def __init__(
        self, session: Session, life: Life, make_groups: Callable[[Communicator], Groups]
    ) -> None:
        self.config = session.config
        self._session = session
        self._life = life
        self._groups = make_groups(self)

    # -- collectives ------------------------------------------------------------------------
    # Each method builds a `Request` and starts it (`Session.start`); see docs/architecture.md.

    @native_arrays(writes=True)
    def all_reduce(
        self, x: Array, op: Any = "sum", *, algorithm: str = "auto", timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Reduce x over all ranks, in place on every rank; the handle gives x."""
        request = Request("all_reduce", x, op=op, algorithm=algorithm, timeout=timeout)
        return self._session.start(request)

    @native_arrays(writes=True)
    def reduce(
        self, x: Array, root: int = 0, op: Any = "sum", *, timeout: float | None = None
    ) -> CollectiveHandle[Array | None]:
        """Reduce x onto root (in place there); other ranks get None and keep x."""
        return self._session.start(Request("reduce", x, op=op, root=root, timeout=timeout))

    @native_arrays(writes=True)
    def broadcast(
        self, x: Array, root: int = 0, *, timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Copy root's x into every rank's x (same shape and dtype); the handle gives x."""
        return self._session.start(Request("broadcast", x, root=root, timeout=timeout))

    @native_arrays(writes=False)
    def all_gather(self, x: Array, *, timeout: float | None = None) -> CollectiveHandle[Array]:
        """Every rank's x concatenated along axis 0 in rank order (a new array)."""
        return self._session.start(Request("all_gather", x, timeout=timeout))

    @native_arrays(writes=False)
    def gather(
        self, x: Array, root: int = 0, *, timeout: float | None = None
    ) -> CollectiveHandle[Array | None]:
        """Like all_gather, but only root gets the result; others get None."""
        return self._session.start(Request("gather", x, root=root, timeout=timeout))

    @native_arrays(writes=False)
    def scatter(
        self, x: Array | None = None, root: int = 0, *, timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Rank r receives numpy.array_split(root's x, world_size)[r]; non-roots pass None."""
        return self._session.start(Request("scatter", x, root=root, timeout=timeout))

    @native_arrays(writes=False)
    def reduce_scatter(
        self, x: Array, op: Any = "sum", *, timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Rank r receives the reduction of numpy.array_split(x, world_size)[r]."""
        return self._session.start(Request("reduce_scatter", x, op=op, timeout=timeout))

    @native_arrays(writes=False)
    def all_to_all(self, x: Array, *, timeout: float | None = None) -> CollectiveHandle[Array]:
        """Part j of numpy.array_split(x, world_size) goes to rank j; parts received are
        concatenated in rank order."""
        return self._session.start(Request("all_to_all", x, timeout=timeout))

    def barrier(self, *, timeout: float | None = None) -> CollectiveHandle[None]:
        """Return once every rank has entered the barrier."""
        return self._session.start(Request("barrier", timeout=timeout))

    # -- point to point ---------------------------------------------------------------------

    @native_arrays(writes=False)
    def send(
        self, x: Array, dst: int, *, tag: int = 0, timeout: float | None = None
    ) -> CollectiveHandle[None]:
        """Send x to rank dst; ordered per (source, destination, tag).

        The handle completes once x may be modified again (not when dst has received it).
        """
        return self._session.send(x, dst, tag, timeout)

    def recv(
        self, src: int, *, tag: int = 0, timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Receive the next array rank src sent with this tag (a new array on comm.device)."""
        return self._session.recv(src, tag, timeout)

    # -- the dependency engine --------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """This rank's dependency engine (created on first use, closed with the communicator)."""
        return self._session.engine_link.engine

    @property
    def var(self) -> Var:
        """The var that orders collectives in the engine: push them with it in `mutate`."""
        return self._session.engine_link.var

    def push_all_reduce(
        self,
        tagged: Tagged[Array],
        op: Any = "sum",
        *,
        read: Iterable[Var] = (),
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> OpHandle[Array]:
        """Push `all_reduce(tagged.data, op)` into the engine; returns the op's handle.

        Two ops are pushed. The first waits for earlier writers of `tagged.var` (and for
        `read`) and for the previous collective to be *issued* (it mutates `comm.var`), then
        starts the all_reduce; the second waits for it to finish and mutates `tagged.var`,
        so later readers of the data see the result. Collectives are thus issued in push
        order on every rank yet several can be in flight. The first op takes its turn even
        if `tagged.var` is poisoned: it then fails the collective on every rank instead of
        leaving the ranks' collective ids out of step. `algorithm` and `timeout` are
        all_reduce's.
        """
        data = tagged.data  # read once: an earlier op may replace it any moment
        return self._push(
            tagged,
            read,
            data,
            lambda x: Request("all_reduce", x, op=op, algorithm=algorithm, timeout=timeout),
        )

    def push_broadcast(
        self, tagged: Tagged[Array], root: int = 0, *, timeout: float | None = None
    ) -> OpHandle[Array]:
        """Push `broadcast(tagged.data, root)` into the engine (see `push_all_reduce`)."""
        data = tagged.data
        return self._push(
            tagged, (), data, lambda x: Request("broadcast", x, root=root, timeout=timeout)
        )

    def _push(
        self,
        tagged: Tagged[Array],
        read: Iterable[Var],
        data: Array,
        request: Callable[[Array], Request],
    ) -> OpHandle[Array]:
        """Push the collective `request(x)` on `data` as the native array x (torch, JAX,
        DLPack data: as for all_reduce)."""
        push = self._session.engine_link.push_collective
        return with_native(data, True, lambda x: push(tagged, read, request(x), data))

    # -- identity and views -----------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This worker's rank in the view its next collective runs in (0..world_size-1)."""
        return self._session.rank

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
        return self._session.view

    @property
    def member_id(self) -> str:
        return self._session.links.member_id

    @property
    def address(self) -> str:
        """The address this worker's endpoint serves on."""
        links = self._session.links
        assert links.view is not None
        return links.view.members[links.rank].address

    @property
    def evicted(self) -> bool:
        """Whether the registry declared this worker dead; it must join again."""
        return self._session.views.evicted

    @property
    def interrupt_on_join(self) -> bool:
        """When true, the first collective after members joined raises
        `MembershipChangedError` instead of running, so the application can bring the
        joiners up to date first (`dsml.elastic.run` sets it)."""
        return self._session.views.interrupt_on_join

    @interrupt_on_join.setter
    def interrupt_on_join(self, value: bool) -> None:
        self._session.views.interrupt_on_join = bool(value)

    def on_view_change(self, callback: ViewListener) -> Callable[[], None]:
        """Call `callback(old_view, new_view)` each time this rank switches views (on the
        loop, at a collective boundary); returns a function that removes it."""
        listeners = self._session.views.listeners
        listeners.append(callback)
        return lambda: listeners.remove(callback)

    async def wait_view_change(self, timeout: float | None = None) -> View:  # noqa: ASYNC109
        """Wait until the registry announces a view newer than the current one (a member
        lost, left or joined); returns it. It is used from the next collective on."""
        return await self._session.views.wait_known(timeout)

    @property
    def registry_address(self) -> str:
        return self._session.registry.address

    @property
    def device(self) -> str:
        """ "cpu" or "cuda:N": where arrays this communicator creates without an input go
        (`recv`, `scatter` on non-roots). Collectives on an array work on its own device."""
        return self._session.placement.device

    # -- how calls run, and what they did ---------------------------------------------------

    @property
    def cost_model(self) -> CostModel | None:
        """The cost model measured on this view, which `auto` chooses from (docs/auto.md).

        None on a single host (a measured size table decides there), on a sub-group, and,
        across hosts, until the view's first `auto` all_reduce has measured it.
        """
        return self._session.cost_model

    def all_reduce_choice(self, nbytes: int) -> Choice:
        """What `all_reduce(algorithm="auto")` runs now for a numpy array of nbytes
        (`hierarchical` included where auto weighs it: hosts with as many ranks each)."""
        return self._session.all_reduce_choice(nbytes)

    def statistics(self) -> dict[str, int]:
        """Counters of the data plane: messages dropped as malformed, of an older epoch
        (stale), for a finished call (late), held for a view not seen yet; calls in flight."""
        return self._session.statistics()

    def stats(self) -> list[dict[str, Any]]:
        """The recent collectives of this rank (oldest first, at most 256), with where their
        time went.

        Each is a dict: `kind`, `cid`, `epoch`, `bytes`, `algorithm` (what `auto` chose),
        `outcome` ("ok", "running", "cancelled" or the error's type), and seconds:
        `total_s` and its split `waiting_s` (for peers to arrive), `wire_s` (data in
        flight, full queues), `reduce_s`, `copy_s`, `other_s` (the rest). See
        docs/observability.md.
        """
        return [record.as_dict() for record in self._session.runner.stats.recent]

    def dump_flight_record(self, path: str | PathLike[str]) -> Path:
        """Write this rank's flight record (its recent calls, whom they waited for, its
        receives in flight, who it is) to `path` as JSON; a directory gets
        `rank<R>-pid<P>.json` in it. Returns the file written. `dsml flight DIR` reads a
        job's records; see docs/observability.md."""
        return self._session.runner.flight.dump(path)

    def trace(self) -> dict[str, Any]:
        """The recent collectives, and the engine's ops when it records them
        (`CommConfig(engine_trace=True)`), as one Chrome / Perfetto trace-event dict."""
        return self._session.trace()

    def write_trace(self, path: str | PathLike[str]) -> None:
        """Write `trace()` to `path` as JSON (open it at https://ui.perfetto.dev)."""
        with open(path, "w", encoding="utf-8") as file:
            json.dump(self.trace(), file)

    # -- sub-communicators ------------------------------------------------------------------

    async def split(
        self,
        color: int | None,
        key: int | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the all_gather's, as on every call)
    ) -> Communicator | None:
        """Split the group into sub-communicators, one per colour (MPI_Comm_split).

        Every rank calls it (it is a collective). Ranks that pass the same `color` (an int
        >= 0) form one sub-communicator, ranked by `key` (default 0), ties broken by their
        rank here; a rank that passes None gets None. Collectives on a sub-communicator run
        concurrently with this communicator's; a lost member fails the calls of both, and
        after a change of view the sub-communicator refuses calls (split again).

        A sub-communicator splits the same way (a nested split): every rank of it calls
        `split`, colours and keys order its ranks, and the groups made close with it.

        Raises:
            ConfigError: on every rank, if any rank passed an invalid color or key.
        """
        return await self._groups.split(color, key, timeout=timeout)

    async def new_group(
        self,
        ranks: Sequence[int],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the all_gather's, as on every call)
    ) -> Communicator | None:
        """A sub-communicator of `ranks` (sub-rank i is ranks[i]); None on other ranks.

        Every rank calls it with the same list (it is a collective). On a
        sub-communicator, `ranks` are its own ranks (a nested group).

        Raises:
            ConfigError: on every rank, if the lists differ or one is invalid.
        """
        return await self._groups.new_group(ranks, timeout=timeout)

    # -- lifecycle --------------------------------------------------------------------------

    def on_close(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Await fn() at the end of `aclose` (dsml.init: the registry this rank serves)."""
        self._life.on_close(fn)

    async def aclose(self, *, error: BaseException | None = None, cancel: bool = False) -> None:
        """Close: finish (or with `cancel`, cancel) engine ops, cancel calls in flight, say
        goodbye to the peers, leave the group, close the sockets. Sub-groups split from
        this communicator close first; a sub-group's close leaves its parent open.

        `error` (set when `async with` exits by an exception) tells the peers why this rank
        left, so their pending and later calls fail naming it instead of waiting.
        """
        if not self._session.runner.closed:
            await self._life.aclose(self._groups, error, cancel)

    async def _crash(self) -> None:
        """Stop as if the process had been killed: no goodbye, no leave, sockets closed
        at once, calls in flight cancelled (see `dsml.testing.crash`)."""
        if not self._session.runner.closed:
            await self._life.crash(self._groups)

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
        s = self._session
        if s.links.view is None:
            return "<Communicator (not joined)>"
        state = " closed" if s.runner.closed else ""
        return (
            f"<Communicator rank={self.rank}/{self.world_size} epoch={self.epoch} "
            f"address={self.address} in_flight={len(s.table.calls)}{state}>"
        )
