"""The communicator of a sub-group (`comm.split`, `comm.new_group`; communicator layer).

The same public methods as its parent (it is a `Communicator`), over parts of its own:
links that go through the parent's (`SubLinks`), a call table and a runner of its own, the
parent's tasks and device. See subgroups.py for how messages are routed and how failures
reach it.
"""

from __future__ import annotations

from .call_table import CallTable
from .communicator import Communicator
from .engine_link import EngineLink
from .p2p import PointToPoint
from .plans import Planner
from .runner import Runner
from .subgroups import SubLinks, SubViews

__all__ = ["SubCommunicator"]


class SubCommunicator(Communicator):
    """A communicator over `members` (the parent's ranks, in sub-rank order)."""

    def __init__(self, parent: Communicator, group: int, members: list[int]) -> None:
        # Not Communicator.__init__: no endpoint, no registry link, no views of its own.
        self.parent = parent
        self.group = group
        self.config = parent.config
        self._tasks = parent._tasks
        self._registry = parent._registry
        self._sub_links = SubLinks(parent._links, parent._tasks, group, members)
        self._links = self._sub_links
        self._table = CallTable(self._links, self.config)
        views = SubViews(self._sub_links, lambda: parent._links.epoch)
        self._views = views.as_view_changes()
        self._placement = parent._placement
        planner = Planner(self.config.chunk_bytes, self._placement)
        self._runner = Runner(
            self._table, self._views, planner, self._tasks, self.config, parent._loop
        )
        self._p2p = PointToPoint(self._table, self._placement)
        self._engine_link = EngineLink(
            self._runner,
            self._start,
            lambda: (self.rank, self.epoch),
            trace=self.config.engine_trace,
        )
        self._loop = parent._loop
        self._splits = 0
        self._subs = []
        parent._table.children.append(self._table)
        parent._demux.add(group, self._table.inbound, members)

    async def aclose(self, *, error: BaseException | None = None, cancel: bool = False) -> None:
        """Cancel this sub-group's calls in flight and tell its members; the parent stays."""
        if self._runner.closed:
            return
        await self._engine_link.aclose(cancel=cancel or error is not None)
        await self._runner.cancel_all()
        reason = f"{type(error).__name__}: {error}" if error is not None else None
        if self.parent._links.view is not None and self._views.immediate():
            self._links.say_goodbye(self._table.next_cid - 1, reason)
        self._detach()

    async def _crash(self) -> None:
        await self._runner.cancel_all()
        await self._engine_link.aclose(cancel=True)
        self._detach()

    def _detach(self) -> None:
        parent = self.parent
        parent._demux.remove(self.group)
        if self._table in parent._table.children:
            parent._table.children.remove(self._table)
        if self in parent._subs:
            parent._subs.remove(self)

    def __repr__(self) -> str:
        state = " closed" if self._runner.closed else ""
        return (
            f"<SubCommunicator rank={self._links.rank}/{self._links.size} "
            f"epoch={self._links.epoch} parent ranks={self._sub_links.members} "
            f"in_flight={len(self._table.calls)}{state}>"
        )
