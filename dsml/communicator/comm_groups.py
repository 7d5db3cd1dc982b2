"""Making sub-communicators: `comm.split` and `comm.new_group` (communicator layer).

`CommunicatorGroups` is the part of `Communicator` (communicator.py) that makes
sub-groups: every rank all-gathers its arguments over the group, checks them the same
way, and builds the `SubCommunicator` (sub_communicator.py) of its own group; how their
messages are routed and numbered is in subgroups.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, cast

import numpy as np

from ..errors import ConfigError, MembershipChangedError
from . import subgroups
from .comm_calls import CommunicatorCalls
from .plan_base import as_int

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["CommunicatorGroups"]


class CommunicatorGroups(CommunicatorCalls):
    """The methods that make sub-communicators; see the module docstring."""

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
        index = self._take_split()
        valid = subgroups.check_split_args(color, key)
        row = [int(valid), int(color is not None and valid), 0, 0, self._reserve_number()]
        if valid:
            row[2], row[3] = color or 0, key or 0
        gathered = await self.all_gather(np.array([row], dtype=np.int64), timeout=timeout)
        rows = gathered.tolist()
        self._check_same_view(len(rows))
        bad = [r for r, (ok, *_rest) in enumerate(rows) if not ok]
        if bad:
            raise ConfigError(
                f"comm.split: rank(s) {bad} passed an invalid color or key (color: an int >= 0 "
                "or None; key: an int or None); no sub-communicator was made"
            )
        mine = subgroups.split_members([r[1:4] for r in rows], self._links.rank)
        if mine is None:
            return None
        color_index, members = mine
        leader = members[0]  # its reserved number names the group (nested splits)
        return self._sub(self._number(index, color_index, leader, rows[leader][4]), members)

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
        index = self._take_split()
        # a list, a tuple, a range or a numpy array of integers (numpy's own included);
        # anything else is invalid here and on every rank (the all_gather below says so)
        given: list[int | None] = []
        if not isinstance(ranks, str | bytes) and isinstance(ranks, Iterable):
            try:  # at most one more than fit: an endless iterable is simply too long
                given = [as_int(r) for r in itertools.islice(ranks, self.world_size + 1)]
            except TypeError:  # a 0-d array, say
                given = []
        members = [r for r in given if r is not None and 0 <= r < self.world_size]
        valid = bool(members) and len(members) == len(given) and len(set(members)) == len(members)
        row = [int(valid), self._reserve_number(), *(members if valid else [])]
        sized = np.array([1 + len(row), *row], dtype=np.int64)  # rows' lengths differ
        rows = subgroups.unpack_rows((await self.all_gather(sized, timeout=timeout)).tolist())
        self._check_same_view(len(rows))
        if not valid:
            raise ConfigError(
                f"comm.new_group: rank {self.rank} passed an invalid list {ranks!r} "
                f"(distinct ranks in 0..{self.world_size - 1}); no group was made"
            )
        if any(not ok or theirs != members for ok, _reserved, *theirs in rows):
            raise ConfigError(
                "comm.new_group: the ranks did not all pass the same valid list of ranks "
                f"(this rank passed {ranks!r}); no group was made"
            )
        if self._links.rank not in members:
            return None
        leader = members[0]
        return self._sub(self._number(index, 0, leader, rows[leader][1]), members)

    def _check_same_view(self, gathered: int) -> None:
        """The group must not have changed between the all_gather and making the group."""
        if gathered != self._links.size:
            raise MembershipChangedError(
                f"the group changed while rank {self._links.rank} was splitting it (epoch "
                f"{self._links.epoch}); split again once the new view is in place",
                rank=self._links.rank,
                epoch=self._links.epoch,
            )

    def _take_split(self) -> int:
        self._splits += 1
        return self._splits

    # How sub-groups are numbered and whose ranks they hold: the root communicator's
    # answers; a sub-communicator (nested splits) overrides them.

    @property
    def _root(self) -> Communicator:
        """The communicator whose links and demultiplexer every sub-group uses."""
        return cast("Communicator", self)

    def _root_ranks(self, ranks: Sequence[int]) -> list[int]:
        """`ranks` of this communicator as the root's ranks."""
        return list(ranks)

    def _reserve_number(self) -> int:
        """This rank's contribution to numbering the groups of a split (see subgroups.py)."""
        return 0

    def _number(self, index: int, color_index: int, leader: int, reserved: int) -> int:
        """The number of the group of colour `color_index` of split #`index`, led by rank
        `leader`, which reserved `reserved`: the same on its members, unique on each."""
        return subgroups.group_id(index, color_index)

    def _sub(self, group: int, members: list[int]) -> Communicator:
        from .sub_communicator import SubCommunicator

        sub = SubCommunicator(cast("Communicator", self), group, members)
        self._subs.append(sub)
        return sub
