"""What a communicator is and what it has seen (communicator layer).

`CommunicatorInfo` is the first of the parts `Communicator` (communicator.py) is made of:
its identity in the view the next collective runs in (rank, world size, epoch), the views
themselves (listeners, waiting for a change), its device, the cost model `auto` chooses
from, its dependency engine, and the record of recent calls (statistics, stats, traces).
It also names, with their types, the parts that `Communicator.__init__` (or
`SubCommunicator.__init__`) wires together, which every part of the class uses.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from os import PathLike
from typing import TYPE_CHECKING, Any

from ..collectives.cost import Choice, CostModel
from ..collectives.cost_auto import AutoChooser
from ..config import CommConfig
from ..engine import Engine, Var
from ..engine.trace import TraceRecorder
from ..membership import RegistryClient, View
from .call_table import CallTable
from .engine_link import EngineLink
from .links import PeerLinks
from .p2p import PointToPoint
from .placement import Placement
from .runner import Runner
from .subgroups import Demux
from .tasks import TaskOwner
from .view_changes import ViewChanges, ViewListener

if TYPE_CHECKING:
    from .communicator import Communicator
    from .shm_hook import ShmHook

__all__ = ["CommunicatorInfo"]


class CommunicatorInfo:
    """A communicator's identity, views, device, engine and records; see the module
    docstring."""

    # The parts, wired by `Communicator.__init__` (a sub-communicator wires its own).
    config: CommConfig
    _links: PeerLinks
    _tasks: TaskOwner
    _registry: RegistryClient
    _table: CallTable
    _views: ViewChanges
    _placement: Placement
    _auto: AutoChooser
    _runner: Runner
    _p2p: PointToPoint
    _engine_link: EngineLink
    _loop: asyncio.AbstractEventLoop
    _demux: Demux
    _splits: int
    _subs: list[Communicator]

    # -- identity ---------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This worker's rank in the view its next collective runs in (0..world_size-1)."""
        view = self.view
        rank = view.rank_of(self._links.member_id)
        return rank if rank is not None else self._links.rank

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
        return self._views.next_view()

    @property
    def member_id(self) -> str:
        return self._links.member_id

    @property
    def address(self) -> str:
        """The address this worker's endpoint serves on."""
        assert self._links.view is not None
        return self._links.view.members[self._links.rank].address

    @property
    def evicted(self) -> bool:
        """Whether the registry declared this worker dead; it must join again."""
        return self._views.evicted

    @property
    def interrupt_on_join(self) -> bool:
        """When true, the first collective after members joined raises
        `MembershipChangedError` instead of running, so the application can bring the
        joiners up to date first (`dsml.elastic.run` sets it)."""
        return self._views.interrupt_on_join

    @interrupt_on_join.setter
    def interrupt_on_join(self, value: bool) -> None:
        self._views.interrupt_on_join = bool(value)

    def on_view_change(self, callback: ViewListener) -> Callable[[], None]:
        """Call `callback(old_view, new_view)` each time this rank switches views (on the
        loop, at a collective boundary); returns a function that removes it."""
        self._views.listeners.append(callback)
        return lambda: self._views.listeners.remove(callback)

    async def wait_view_change(self, timeout: float | None = None) -> View:  # noqa: ASYNC109
        """Wait until the registry announces a view newer than the current one (a member
        lost, left or joined); returns it. It is used from the next collective on."""
        return await self._views.wait_known(timeout)

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
        """What `all_reduce(algorithm="auto")` runs now for a numpy array of nbytes
        (`hierarchical` included where auto weighs it: hosts with as many ranks each)."""
        shm: ShmHook | None = getattr(self, "_shm", None)  # sub-communicators have none
        hierarchical = shm is not None and shm.weighs_hierarchical()
        return self._auto.choice(nbytes, self._links.size, hierarchical)

    def statistics(self) -> dict[str, int]:
        """Counters of the data plane: messages dropped as malformed, of an older epoch
        (stale), for a finished call (late), held for a view not seen yet; calls in flight."""
        return {
            "dropped": self._links.dropped_total,
            "stale": self._links.counters["stale"] + self._table.counters["stale"],
            "late": self._table.counters["late"],
            "held": self._links.counters["held"],
            "dropped_foreign": self._links.counters["dropped_foreign"],
            "dropped_over_budget": self._links.counters["dropped_over_budget"],
            "disconnects": self._links.counters["disconnects"],
            "views_installed": self._views.installed,
            "in_flight": len(self._table.calls),
            "next_cid": self._table.next_cid,
        }

    def stats(self) -> list[dict[str, Any]]:
        """The recent collectives of this rank (oldest first, at most 256), with where their
        time went.

        Each is a dict: `kind`, `cid`, `epoch`, `bytes`, `algorithm` (what `auto` chose),
        `outcome` ("ok", "running", "cancelled" or the error's type), and seconds:
        `total_s` and its split `waiting_s` (for peers to arrive), `wire_s` (data in
        flight, full queues), `reduce_s`, `copy_s`, `other_s` (the rest). See
        docs/observability.md.
        """
        return [record.as_dict() for record in self._runner.stats.recent]

    def trace(self) -> dict[str, Any]:
        """The recent collectives, and the engine's ops when it records them
        (`CommConfig(engine_trace=True)`), as one Chrome / Perfetto trace-event dict."""
        spans = [record.span() for record in self._runner.stats.recent]
        if self.config.engine_trace:
            return self.engine.trace(extra=spans)
        return TraceRecorder().chrome_trace(f"dsml rank {self.rank}", spans)

    def write_trace(self, path: str | PathLike[str]) -> None:
        """Write `trace()` to `path` as JSON (open it at https://ui.perfetto.dev)."""
        with open(path, "w", encoding="utf-8") as file:
            json.dump(self.trace(), file)

    # -- the dependency engine --------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """This rank's dependency engine (created on first use, closed with the communicator)."""
        return self._engine_link.engine

    @property
    def var(self) -> Var:
        """The var that orders collectives in the engine: push them with it in `mutate`."""
        return self._engine_link.var
