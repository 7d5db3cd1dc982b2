"""The communicator of a sub-group (`comm.split`, `comm.new_group`; communicator layer).

A sub-group's communicator is a `Communicator` like its parent, over a `Session` of its
own: links that go through the root communicator's (`SubLinks`), a view fixed while the
root stays in its epoch (`SubViews`), a call table and a runner of its own, the parent's
tasks, registry and device. `open_sub` makes it; `SubLife` closes it (the parent stays).
It can be split again (`NestedGroups`): the groups it makes are sub-groups of the root
like it (their members as the root's ranks), numbered from numbers their members reserve
(`nested_group_id`), and closed with it. See subgroups.py for how messages are routed
and how failures reach it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from . import subgroups
from .call_table import CallTable
from .communicator import Communicator
from .groups import Groups
from .session import CLOSE_GRACE_S, Session
from .subgroups import SubLinks, SubViews

__all__ = ["open_sub"]


def open_sub(parent: Groups, group: int, members: list[int]) -> Communicator:
    """The communicator over `members` (ranks of the communicator `parent` splits, in
    sub-rank order), as sub-group number `group` of the root."""
    root, p = parent.root, parent.session
    root_members = parent.root_ranks(members)
    root_links = root.session.links
    links = SubLinks(root_links, p.tasks, group, root_members)
    views = SubViews(links, lambda: root_links.epoch, root.sub_group_error)
    table = CallTable(links, p.config)
    session = Session(p.config, p.loop, p.tasks, p.registry, links, table, views, p.placement)
    life = SubLife(session, root, group, parent)
    comm = Communicator(session, life, lambda c: NestedGroups(c, session, root, links, views))
    root.attach(group, table, root_members)
    return comm


class SubLife:
    """Closing a sub-group: cancel its calls in flight and tell its members; the parent
    stays. The groups split from it close first."""

    def __init__(self, session: Session, root: Groups, group: int, parent: Groups) -> None:
        self._s = session
        self._root = root
        self._group = group
        self._parent = parent
        self._on_close: list[Callable[[], Awaitable[None]]] = []

    def on_close(self, fn: Callable[[], Awaitable[None]]) -> None:
        self._on_close.append(fn)

    async def aclose(self, groups: Groups, error: BaseException | None, cancel: bool) -> None:
        s = self._s
        await groups.aclose(error, cancel)  # they say goodbye in their group before we do
        await s.engine_link.aclose(cancel=cancel or error is not None)
        await s.runner.cancel_all()
        reason = f"{type(error).__name__}: {error}" if error is not None else None
        await s.p2p.settle(CLOSE_GRACE_S)  # refused sends say why before the goodbye
        if self._root.session.links.view is not None and s.views.immediate():
            s.links.say_goodbye(s.table.next_cid - 1, reason)
        self._detach()
        for fn in self._on_close:
            await fn()

    async def crash(self, groups: Groups) -> None:
        await groups.crash()
        await self._s.runner.cancel_all()
        await self._s.engine_link.aclose(cancel=True)
        self._detach()

    def _detach(self) -> None:
        self._root.detach(self._group, self._s.table)
        self._parent.forget(self._group)


class NestedGroups(Groups):
    """The sub-groups split from a sub-communicator: numbered and ranked as the root's."""

    def __init__(
        self, comm: Communicator, session: Session, root: Groups, links: SubLinks, views: SubViews
    ) -> None:
        super().__init__(comm, session, open_sub)
        self._root = root
        self._links = links
        self._views = views

    @property
    def root(self) -> Groups:
        return self._root

    def root_ranks(self, ranks: Sequence[int]) -> list[int]:
        return [self._links.members[r] for r in ranks]

    def reserve_number(self) -> int:
        return self._root.reserve_nested()

    def number(self, index: int, color_index: int, leader: int, reserved: int) -> int:
        leader_root = self._links.members[leader]
        return subgroups.nested_group_id(leader_root, reserved, self._links.root_size)

    def check_same_view(self, gathered: int) -> None:
        super().check_same_view(gathered)
        stale = self._views.stale()  # the root moved on during the split's all_gather
        if stale is not None:
            raise stale
