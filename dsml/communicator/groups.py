"""Making sub-communicators: `comm.split` and `comm.new_group` (communicator layer).

`Groups` makes the sub-groups of one communicator: every rank all-gathers its arguments
over the group, checks them the same way, and opens the communicator of its own group
(`open_sub`, sub_communicator.py); it keeps the groups it made, to close them
first. How sub-groups are numbered and whose ranks they hold is the root communicator's
answer here; a sub-communicator's `NestedGroups` (nested splits) answers for its own.
How their messages are routed is in subgroups.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ConfigError, DsmlError, MembershipChangedError
from . import subgroups
from .call_table import CallTable
from .plan_base import as_int
from .session import Session

if TYPE_CHECKING:
    from .communicator import Communicator

OpenSub = Callable[["Groups", int, list[int]], "Communicator"]  # sub_communicator.open_sub

__all__ = ["Groups"]


class Groups:
    """The sub-groups split from one communicator (`comm`, running on `session`)."""

    def __init__(
        self,
        comm: Communicator,
        session: Session,
        open_sub: OpenSub,
        sub_group_error: Callable[[], DsmlError | None] = lambda: None,
    ) -> None:
        self.comm = comm
        self.session = session
        self.sub_group_error = sub_group_error  # the root's: its epoch lost members
        self.subs: dict[int, Communicator] = {}  # open sub-groups made here, by number
        self._open_sub = open_sub  # sub_communicator.open_sub
        self._splits = 0  # split/new_group calls so far: numbers sub-groups alike everywhere
        self._nested = 0  # numbers this rank reserved for nested splits (subgroups.py)

    async def split(
        self,
        color: int | None,
        key: int | None,
        *,
        timeout: float | None,  # noqa: ASYNC109 (the all_gather's, as on every call)
    ) -> Communicator | None:
        """`Communicator.split`: all-gather the arguments, check them alike, make ours."""
        index = self._take_split()
        valid = subgroups.check_split_args(color, key)
        row = [int(valid), int(color is not None and valid), 0, 0, self.reserve_number()]
        if valid:
            row[2], row[3] = color or 0, key or 0
        gathered = await self.comm.all_gather(np.array([row], dtype=np.int64), timeout=timeout)
        rows = gathered.tolist()
        self.check_same_view(len(rows))
        bad = [r for r, (ok, *_rest) in enumerate(rows) if not ok]
        if bad:
            raise ConfigError(
                f"comm.split: rank(s) {bad} passed an invalid color or key (color: an int >= 0 "
                "or None; key: an int or None); no sub-communicator was made"
            )
        mine = subgroups.split_members([r[1:4] for r in rows], self.session.links.rank)
        if mine is None:
            return None
        color_index, members = mine
        leader = members[0]  # its reserved number names the group (nested splits)
        return self.make(self.number(index, color_index, leader, rows[leader][4]), members)

    async def new_group(
        self,
        ranks: Sequence[int],
        *,
        timeout: float | None,  # noqa: ASYNC109 (the all_gather's, as on every call)
    ) -> Communicator | None:
        """`Communicator.new_group`: all-gather the lists, check them alike, make ours."""
        index = self._take_split()
        # a list, a tuple, a range or a numpy array of integers (numpy's own included);
        # anything else is invalid here and on every rank (the all_gather below says so)
        given: list[int | None] = []
        if not isinstance(ranks, str | bytes) and isinstance(ranks, Iterable):
            try:  # at most one more than fit: an endless iterable is simply too long
                given = [as_int(r) for r in itertools.islice(ranks, self.comm.world_size + 1)]
            except TypeError:  # a 0-d array, say
                given = []
        members = [r for r in given if r is not None and 0 <= r < self.comm.world_size]
        valid = bool(members) and len(members) == len(given) and len(set(members)) == len(members)
        row = [int(valid), self.reserve_number(), *(members if valid else [])]
        sized = np.array([1 + len(row), *row], dtype=np.int64)  # rows' lengths differ
        rows = subgroups.unpack_rows((await self.comm.all_gather(sized, timeout=timeout)).tolist())
        self.check_same_view(len(rows))
        if not valid:
            raise ConfigError(
                f"comm.new_group: rank {self.comm.rank} passed an invalid list {ranks!r} "
                f"(distinct ranks in 0..{self.comm.world_size - 1}); no group was made"
            )
        if any(not ok or theirs != members for ok, _reserved, *theirs in rows):
            raise ConfigError(
                "comm.new_group: the ranks did not all pass the same valid list of ranks "
                f"(this rank passed {ranks!r}); no group was made"
            )
        if self.session.links.rank not in members:
            return None
        leader = members[0]
        return self.make(self.number(index, 0, leader, rows[leader][1]), members)

    def check_same_view(self, gathered: int) -> None:
        """The group must not have changed between the all_gather and making the group."""
        links = self.session.links
        if gathered != links.size:
            raise MembershipChangedError(
                f"the group changed while rank {links.rank} was splitting it (epoch "
                f"{links.epoch}); split again once the new view is in place",
                rank=links.rank,
                epoch=links.epoch,
            )

    def _take_split(self) -> int:
        self._splits += 1
        return self._splits

    def make(self, group: int, members: list[int]) -> Communicator:
        """The communicator of sub-group `group` (members: this communicator's ranks)."""
        sub = self._open_sub(self, group, members)
        self.subs[group] = sub
        return sub

    def forget(self, group: int) -> None:
        """Sub-group `group` closed: it is no longer one to close first."""
        self.subs.pop(group, None)

    def attach(self, group: int, table: CallTable, members: list[int]) -> None:
        """Route sub-group `group`'s messages (from the root's ranks `members`) to `table`,
        and fail its calls with the root's (the root's `Groups` does this)."""
        assert self.session.demux is not None, "sub-groups attach to the root"
        self.session.table.adopt(table)
        self.session.demux.add(group, table.inbound, members)

    def detach(self, group: int, table: CallTable) -> None:
        """Undo `attach`: the sub-group closed."""
        assert self.session.demux is not None
        self.session.demux.remove(group)
        self.session.table.disown(table)

    async def aclose(self, error: BaseException | None, cancel: bool) -> None:
        """Close the open sub-groups (they say goodbye in their group before comm does)."""
        for sub in list(self.subs.values()):
            await sub.aclose(error=error, cancel=cancel)

    async def crash(self) -> None:
        for sub in list(self.subs.values()):
            await sub._crash()

    # How sub-groups are numbered and whose ranks they hold: the root communicator's
    # answers; a sub-communicator's `NestedGroups` (nested splits) overrides them.

    @property
    def root(self) -> Groups:
        """The groups of the communicator whose links and demultiplexer every sub-group
        uses."""
        return self

    def root_ranks(self, ranks: Sequence[int]) -> list[int]:
        """`ranks` of this communicator as the root's ranks."""
        return list(ranks)

    def reserve_number(self) -> int:
        """This rank's contribution to numbering the groups of a split (see subgroups.py)."""
        return 0

    def reserve_nested(self) -> int:
        """The root's next number for a nested split of one of its sub-groups."""
        self._nested += 1
        return self._nested - 1

    def number(self, index: int, color_index: int, leader: int, reserved: int) -> int:
        """The number of the group of colour `color_index` of split #`index`, led by rank
        `leader`, which reserved `reserved`: the same on its members, unique on each."""
        return subgroups.group_id(index, color_index)
