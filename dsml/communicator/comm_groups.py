"""Making sub-communicators: `comm.split` and `comm.new_group` (communicator layer).

`CommunicatorGroups` is the part of `Communicator` (communicator.py) that makes
sub-groups: every rank all-gathers its arguments over the group, checks them the same
way, and builds the `SubCommunicator` (sub_communicator.py) of its own group; how their
messages are routed and numbered is in subgroups.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import numpy as np

from ..errors import ConfigError, MembershipChangedError
from . import subgroups
from .comm_calls import CommunicatorCalls

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

        Raises:
            ConfigError: on every rank, if any rank passed an invalid color or key.
        """
        index = self._take_split()
        valid = subgroups.check_split_args(color, key)
        row = [int(valid), int(color is not None and valid), 0, 0]
        if valid:
            row[2], row[3] = color or 0, key or 0
        rows = await self.all_gather(np.array([row], dtype=np.int64), timeout=timeout)
        self._check_same_view(len(rows))
        bad = [r for r, (ok, *_rest) in enumerate(rows.tolist()) if not ok]
        if bad:
            raise ConfigError(
                f"comm.split: rank(s) {bad} passed an invalid color or key (color: an int >= 0 "
                "or None; key: an int or None); no sub-communicator was made"
            )
        mine = subgroups.split_members([r[1:] for r in rows.tolist()], self._links.rank)
        if mine is None:
            return None
        color_index, members = mine
        return self._sub(subgroups.group_id(index, color_index), members)

    async def new_group(
        self,
        ranks: Sequence[int],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the all_gather's, as on every call)
    ) -> Communicator | None:
        """A sub-communicator of `ranks` (sub-rank i is ranks[i]); None on other ranks.

        Every rank calls it with the same list (it is a collective).

        Raises:
            ConfigError: on every rank, if the lists differ or one is invalid.
        """
        index = self._take_split()
        members = list(ranks) if isinstance(ranks, Sequence) else []
        valid = (
            bool(members)
            and all(type(r) is int and 0 <= r < self.world_size for r in members)
            and len(set(members)) == len(members)
        )
        row = np.array([int(valid), *(members if valid else [])], dtype=np.int64)
        flat = (await self.all_gather(row, timeout=timeout)).tolist()
        self._check_same_view(self._links.size)
        lists, at = [], 0
        for _ in range(self.world_size):  # each rank's row: valid, then its ranks if valid
            ok = flat[at]
            count = len(members) if ok and valid else 0
            if ok and not valid:
                raise ConfigError(
                    f"comm.new_group: rank {self.rank} passed an invalid list {ranks!r} "
                    f"(distinct ranks in 0..{self.world_size - 1}); no group was made"
                )
            lists.append(flat[at + 1 : at + 1 + count] if ok else None)
            at += 1 + count
        if at != len(flat) or any(other != members for other in lists):
            raise ConfigError(
                "comm.new_group: the ranks did not all pass the same valid list of ranks "
                f"(this rank passed {ranks!r}); no group was made"
            )
        if self._links.rank not in members:
            return None
        return self._sub(subgroups.group_id(index, 0), members)

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
        if isinstance(self._links, subgroups.SubLinks):
            raise ConfigError("a sub-communicator cannot be split again: split its parent instead")
        self._splits += 1
        return self._splits

    def _sub(self, group: int, members: list[int]) -> Communicator:
        from .sub_communicator import SubCommunicator

        sub = SubCommunicator(cast("Communicator", self), group, members)
        self._subs.append(sub)
        return sub
