"""Sub-communicators: `comm.split(color, key)` and `comm.new_group(ranks)` (communicator).

A sub-communicator is a communicator over some members of its parent's view, with its own
collective ids, call table and runner, so its collectives run concurrently with the
parent's and with other sub-groups'. Its messages travel over the parent's peer links:
`SubLinks` maps sub-ranks to the parent's ranks and stamps every envelope's collective id
with the sub-group's number in the high bits (`group << 32 | cid`); `Demux`, in front of
the parent's call table, routes arriving messages by those bits and maps the sender back
to its sub-rank. Messages for a sub-group this rank has not made yet (a peer finished the
split first) are held, within a budget, until it exists.

Group numbers need no message of their own: the k-th split (or new_group) of a parent
numbers its colours in sorted order, `group_id(k, i)`, the same on every rank.

A sub-communicator can be split again (a nested split). The nested group is a sub-group
of the root communicator like any other: its `SubLinks` go straight through the root's
links, with its members as the root's ranks, and the root's `Demux` routes its messages.
Its number comes from the split's all_gather: every rank reserves a number of its own for
each nested split it takes part in, and a group's number is `nested_group_id` of its rank
0 (as a root rank) and what that rank reserved. A rank leads at most one group per split
and never reserves a number twice, so no two groups of a rank share a number, whatever
order concurrent splits of different sub-communicators run in.

A sub-communicator lives in its root's epoch. A failure of the root's calls (a member
lost, this rank evicted) fails the sub-groups' calls too, nested ones included
(`CallTable.adopt`): a member's death fails all of them. Once the root has moved to a
new view, a sub-communicator of the old one refuses calls with `MembershipChangedError`:
split again.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, DsmlError, MembershipChangedError, ProtocolError
from ..membership import View
from ..transport import Sent
from ..wire import Envelope, Kind
from .links import Inbound, PeerLinks
from .plan_base import as_int
from .tasks import TaskOwner

if TYPE_CHECKING:
    from .view_states import ViewListener

__all__ = [
    "GROUP_SHIFT",
    "NESTED",
    "Demux",
    "SubLinks",
    "SubViews",
    "group_id",
    "nested_group_id",
    "split_members",
    "unpack_rows",
]

GROUP_SHIFT = 32  # a sub-group's own collective ids stay below 2**32
_LOCAL = (1 << GROUP_SHIFT) - 1
NESTED = 1 << 30  # numbers of nested sub-groups start here; the root's are below
_MAX_GROUP = (1 << 31) - 1  # a stamped id, group << 32 | cid, stays a positive int64
_MAX_SPLITS = NESTED >> 16  # splits of one root communicator that `group_id` can number
_MAX_EARLY = 10_000  # messages held for sub-groups this rank has not made yet ...
_MAX_EARLY_BYTES = 256 << 20  # ... and their payload bytes


def group_id(split_index: int, color_index: int) -> int:
    """The number of a sub-group: its parent's split counter and the colour's position."""
    if split_index >= _MAX_SPLITS or color_index >= 0xFFFF:
        raise ConfigError(
            f"a communicator can be split at most {_MAX_SPLITS - 1} times, into at most "
            f"{0xFFFF} groups each (this is split #{split_index}, group #{color_index + 1}); "
            "close and re-create the communicator to start again"
        )
    return (split_index << 16) | (color_index + 1)


def nested_group_id(leader: int, reserved: int, root_size: int) -> int:
    """The number of a group made by splitting a sub-communicator (see the module docstring).

    `leader` is the root rank of the new group's rank 0, `reserved` the number that rank
    reserved for this split, `root_size` the size of the root communicator's view.
    """
    assert 0 <= leader < root_size
    assert reserved >= 0
    number = NESTED + reserved * root_size + leader
    if number > _MAX_GROUP:
        raise ConfigError(
            f"rank {leader} took part in {reserved} nested splits: the numbers for nested "
            "sub-groups ran out; close and re-create the communicator to start again"
        )
    return number


def unpack_rows(flat: Sequence[int]) -> list[list[int]]:
    """The rows of an all_gather whose rows each start with their own length."""
    rows, at = [], 0
    while at < len(flat):
        size = flat[at]
        if size < 1:
            raise ProtocolError(f"a gathered row claims a length of {size}")
        rows.append(list(flat[at + 1 : at + size]))
        at += size
    return rows


def split_members(rows: Sequence[Sequence[int]], rank: int) -> tuple[int, list[int]] | None:
    """(colour index, members' parent ranks in sub-rank order) of `rank`, or None.

    `rows[r]` is rank r's (has a colour, colour, key). MPI_Comm_split's rule: the members of
    a colour are ordered by key, then by parent rank; colours are numbered in sorted order.
    """
    has, color, _key = rows[rank]
    if not has:
        return None
    colors = sorted({c for h, c, _ in rows if h})
    members = sorted(
        (r for r, (h, c, _) in enumerate(rows) if h and c == color), key=lambda r: (rows[r][2], r)
    )
    return colors.index(color), members


class SubLinks(PeerLinks):
    """The parent's peer links as a sub-group sees them: sub-ranks, stamped collective ids."""

    def __init__(self, parent: PeerLinks, tasks: TaskOwner, group: int, members: Sequence[int]):
        super().__init__(parent.member_id, parent.config, tasks)
        assert parent.view is not None
        self.parent = parent  # the root communicator's links (a nested group's too)
        self.group = group
        self.members = list(members)  # sub-rank -> the parent's rank
        self.view = View(parent.view.epoch, tuple(parent.view.members[r] for r in members))
        self.rank = self.members.index(parent.rank)
        self.root_size = parent.view.size

    @property
    def dropped(self) -> int:
        return self.parent.dropped

    def _out(self, env: Envelope) -> Envelope:
        if env.cid > _LOCAL:
            raise ConfigError(f"a sub-communicator ran out of collective ids ({env.cid})")
        return env._replace(cid=(self.group << GROUP_SHIFT) | env.cid, src=self.parent.rank)

    def try_send(self, peer: int, env: Envelope, payload: Sequence[Any] = ()) -> Sent | None:
        return self.parent.try_send(self.members[peer], self._out(env), payload)

    def send_in_turn(
        self, peer: int, env: Envelope, payload: Sequence[Any] = ()
    ) -> asyncio.Task[Sent]:
        return self.parent.send_in_turn(self.members[peer], self._out(env), payload)

    def send_control(self, env: Envelope, peers: Sequence[int] | None = None) -> None:
        targets = range(self.size) if peers is None else peers
        self.parent.send_control(
            self._out(env), [self.members[p] for p in targets if p != self.rank]
        )

    def bind(self) -> str:
        raise AssertionError("a sub-group uses its parent's endpoint")

    async def aclose(self) -> None:
        """Nothing to close: the sockets are the parent's."""

    def __repr__(self) -> str:
        return (
            f"<SubLinks group={self.group} rank={self.rank}/{self.size} epoch={self.epoch} "
            f"parent ranks={self.members}>"
        )


class Demux:
    """Routes the parent's inbound peer messages: to its own table, or to a sub-group's."""

    def __init__(self, parent: Mapping[Kind, Inbound]) -> None:
        self._parent = parent
        self._subs: dict[int, tuple[Mapping[Kind, Inbound], dict[int, int]]] = {}
        self._early: dict[int, list[tuple[int, Envelope, list[memoryview]]]] = {}
        self._closed: set[int] = set()  # closed here this epoch (numbers are not reused)
        self._held = 0
        self._held_bytes = 0
        self.routes: dict[Kind, Inbound] = {
            kind: functools.partial(self._dispatch, kind) for kind in parent
        }

    def add(self, group: int, inbound: Mapping[Kind, Inbound], members: Sequence[int]) -> None:
        """Route `group`'s messages to `inbound`; deliver those that came before it."""
        assert group not in self._subs, f"sub-group number {group} is taken"
        self._subs[group] = (inbound, {parent: sub for sub, parent in enumerate(members)})
        early = self._early.pop(group, [])
        self._held -= len(early)
        self._held_bytes -= sum(p.nbytes for _, _, payload in early for p in payload)
        for rank, env, payload in early:
            self._dispatch(env.kind, rank, env, payload)

    def remove(self, group: int) -> None:
        """`group` closed here: what its members still send it (their goodbyes, calls
        this rank gave up) is dropped, not held for a group that will not come back."""
        self._subs.pop(group, None)
        self._closed.add(group)

    def new_epoch(self) -> None:
        """The parent moved to a new view: its sub-groups and what was held for them go."""
        self._subs.clear()
        self._closed.clear()
        self._early.clear()
        self._held = 0
        self._held_bytes = 0

    def _dispatch(self, kind: Kind, rank: int, env: Envelope, payload: list[memoryview]) -> None:
        group = env.cid >> GROUP_SHIFT
        if group == 0:
            self._parent[kind](rank, env, payload)
            return
        sub = self._subs.get(group)
        if sub is None and group in self._closed:
            return
        if sub is None:  # a peer finished the split first: hold it until this rank has
            size = sum(p.nbytes for p in payload)
            if self._held >= _MAX_EARLY or self._held_bytes + size > _MAX_EARLY_BYTES:
                raise ProtocolError(f"too many messages for sub-groups not made here ({group})")
            self._early.setdefault(group, []).append((rank, env, payload))
            self._held += 1
            self._held_bytes += size
            return
        inbound, ranks = sub
        sub_rank = ranks.get(rank)
        if sub_rank is None:
            raise ProtocolError(f"rank {rank} sent a message to sub-group {group}, not its own")
        inbound[kind](sub_rank, env._replace(cid=env.cid & _LOCAL, src=sub_rank), payload)


class SubViews:
    """What the runner and the communicator ask about views, for a sub-group: its view is
    fixed, and valid while the parent stays in the same epoch."""

    def __init__(
        self,
        links: SubLinks,
        parent_epoch: Callable[[], int],
        broken: Callable[[], DsmlError | None] = lambda: None,
    ) -> None:
        self.links = links
        self._parent_epoch = parent_epoch
        self._broken = broken  # the root's `sub_group_error`: its epoch lost members
        self.listeners: list[ViewListener] = []
        self.installed = 1
        self.evicted = False
        self.interrupt_on_join = False

    def stale(self) -> DsmlError | None:
        """The error of a call once the root has left this sub-group's epoch, or while
        that epoch is broken (a member lost: `PeerLostError`, not a wait for the dead)."""
        if self._parent_epoch() == self.links.epoch:
            return self._broken()
        return MembershipChangedError(
            f"this sub-communicator belongs to epoch {self.links.epoch} of its root communicator, "
            f"which has moved to epoch {self._parent_epoch()}: make new sub-groups with "
            "comm.split or comm.new_group",
            rank=self.links.rank,
            epoch=self.links.epoch,
        )

    def immediate(self) -> bool:
        return self.stale() is None

    async def admit(self) -> None:
        error = self.stale()
        if error is not None:
            raise error

    def ensure_current(self) -> None:
        error = self.stale()
        if error is not None:
            raise error

    def next_view(self) -> View:
        assert self.links.view is not None
        return self.links.view

    async def wait_known(self, timeout: float | None = None) -> View:  # noqa: ASYNC109
        raise ConfigError("a sub-communicator has no views of its own: wait on its parent")


def check_split_args(color: object, key: object) -> bool:
    """Whether color (an int or None) and key (an int or None) are valid."""
    color_value, key_value = as_int(color), as_int(key)
    ok_color = color is None or (color_value is not None and 0 <= color_value < 1 << 62)
    ok_key = key is None or (key_value is not None and -(1 << 62) <= key_value < 1 << 62)
    return ok_color and ok_key
