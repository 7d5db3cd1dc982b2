"""The communicator of a sub-group (`comm.split`, `comm.new_group`; communicator layer).

The same public methods as its parent (it is a `Communicator`), over parts of its own:
links that go through the root communicator's (`SubLinks`), a call table and a runner of
its own, the parent's tasks and device. It can be split again: the groups it makes are
sub-groups of the root like it (their members as the root's ranks), numbered from
numbers their members reserve (`nested_group_id`), and closed with it. See subgroups.py
for how messages are routed and how failures reach it.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import subgroups
from .call_table import CallTable
from .communicator import CLOSE_GRACE_S, Communicator
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
        root = parent._root
        root_members = parent._root_ranks(members)
        self.config = parent.config
        self._tasks = parent._tasks
        self._registry = parent._registry
        self._sub_links = SubLinks(root._links, parent._tasks, group, root_members)
        self._links = self._sub_links
        self._table = CallTable(self._links, self.config)
        self._sub_views = SubViews(
            self._sub_links, lambda: root._links.epoch, root._views.sub_group_error
        )
        self._views = self._sub_views.as_view_changes()
        self._placement = parent._placement
        planner = Planner(self.config.chunk_bytes, self._placement)
        self._runner = Runner(
            self._table, self._views, planner, self._tasks, self.config, parent._loop
        )
        self._p2p = PointToPoint(self._table, self._placement, self._tasks)
        self._engine_link = EngineLink(
            self._runner,
            self._start,
            lambda: (self.rank, self.epoch),
            trace=self.config.engine_trace,
        )
        self._loop = parent._loop
        self._splits = 0
        self._subs = []
        root._table.children.append(self._table)  # the root's failures reach its calls
        root._demux.add(group, self._table.inbound, root_members)

    async def aclose(self, *, error: BaseException | None = None, cancel: bool = False) -> None:
        """Cancel this sub-group's calls in flight and tell its members; the parent stays.
        The groups split from it close first."""
        if self._runner.closed:
            return
        for sub in list(self._subs):  # they say goodbye in their group before we do
            await sub.aclose(error=error, cancel=cancel)
        await self._engine_link.aclose(cancel=cancel or error is not None)
        await self._runner.cancel_all()
        reason = f"{type(error).__name__}: {error}" if error is not None else None
        await self._p2p.settle(CLOSE_GRACE_S)  # refused sends say why before the goodbye
        if self._root._links.view is not None and self._views.immediate():
            self._links.say_goodbye(self._table.next_cid - 1, reason)
        self._detach()

    async def _crash(self) -> None:
        for sub in list(self._subs):
            await sub._crash()
        await self._runner.cancel_all()
        await self._engine_link.aclose(cancel=True)
        self._detach()

    def _detach(self) -> None:
        root = self._root
        root._demux.remove(self.group)
        if self._table in root._table.children:
            root._table.children.remove(self._table)
        if self in self.parent._subs:
            self.parent._subs.remove(self)

    # -- nested splits (see comm_groups.py and subgroups.py) ----------------------------------

    @property
    def _root(self) -> Communicator:
        return self.parent._root

    def _root_ranks(self, ranks: Sequence[int]) -> list[int]:
        return [self._sub_links.members[r] for r in ranks]

    def _reserve_number(self) -> int:
        root = self._root
        root._nested_groups += 1
        return root._nested_groups - 1

    def _number(self, index: int, color_index: int, leader: int, reserved: int) -> int:
        leader_root = self._sub_links.members[leader]
        return subgroups.nested_group_id(leader_root, reserved, self._sub_links.root_size)

    def _check_same_view(self, gathered: int) -> None:
        super()._check_same_view(gathered)
        stale = self._sub_views.stale()  # the root moved on during the split's all_gather
        if stale is not None:
            raise stale

    def __repr__(self) -> str:
        state = " closed" if self._runner.closed else ""
        return (
            f"<SubCommunicator rank={self._links.rank}/{self._links.size} "
            f"epoch={self._links.epoch} root ranks={self._sub_links.members} "
            f"in_flight={len(self._table.calls)}{state}>"
        )
