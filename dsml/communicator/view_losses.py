"""A broken epoch, and the errors calls fail with while the group changes (communicator).

`Broken` is what one rank knows of an installed epoch that lost members: who and how, up
to which collective it still runs, whether a call still owes the failure. `ViewChanges`
(view_changes.py) holds one per broken epoch and changes it only through its methods,
the rules of a loss and of a leave (docs/faults.md). The errors are plain functions of
what `ViewChanges` knows, passed in: they build `PeerLostError`, `NoQuorumError` and
`EvictedError` for a call (or, with None, for the next call, which does not run).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import (
    DsmlError,
    EvictedError,
    MembershipChangedError,
    NoQuorumError,
    PeerLostError,
)
from ..membership import Change, View
from .view_states import ViewState

if TYPE_CHECKING:
    from .call import Call
    from .call_table import CallTable
    from .links import PeerLinks
    from .survival import Survival

__all__ = [
    "Broken",
    "changing_error",
    "evicted_error",
    "goodbye_overdue",
    "joined_error",
    "lost_error",
    "no_quorum_error",
    "no_view_error",
    "sub_group_failure",
]

log = logging.getLogger("dsml.communicator")


@dataclass(slots=True)
class Broken:
    """The current epoch lost members: who, and up to which collective it still runs
    (its fields are written by its methods only)."""

    epoch: int
    lost: dict[int, str] = field(default_factory=dict)  # rank -> how it was lost
    limit: int = 0  # calls numbered up to this still run (members that left did them)
    owed: bool = False  # no call failed yet: the next one must
    only_left: bool = False  # members only left (closed): the call table raises their error

    def left(self, last: int, failed: int) -> None:
        """A peer said goodbye after collective `last`; `failed`: calls that failed for it."""
        self.limit = min(self.limit, last)
        self.calls_failed(failed)

    def lose(self, rank: int, why: str) -> None:
        """`rank` is lost (its connection dropped); the epoch no longer only lost leavers."""
        self.only_left = False
        self.lost[rank] = why

    def lose_majority(self) -> None:
        """No majority of the group is reachable (without the registry)."""
        self.only_left = False
        self.lost.setdefault(-1, "no majority of the group is reachable")

    def calls_failed(self, failed: int) -> None:
        """`failed` calls in flight failed with the loss: the next call owes nothing."""
        self.owed = self.owed and not failed

    def take_owed(self) -> bool:
        """Whether the next call must fail (the loss not seen by a call yet); it does now."""
        owed, self.owed = self.owed, False
        return owed

    def view_after(self, view: View, failed: View | None, next_cid: int) -> View | None:
        """The view the next call runs in while this epoch is broken (None: no newer one
        is due): after a loss the registry's next view, once known; after a leave that
        view once the leaver's calls are over here and the failure was seen."""
        if failed is None:
            return None
        if not self.only_left:
            return failed if failed.epoch > view.epoch else view
        if failed.epoch > view.epoch and not self.owed and next_cid > self.limit:
            return failed  # a leave: the calls of the old view are over here
        return None

    def take_change(
        self, installed: View, view: View, change: Change, table: CallTable, links: PeerLinks
    ) -> list[int]:
        """Apply a view that ends the installed epoch without a boundary: the calls of
        members that left run up to their last one; a loss fails every call in flight.
        Returns the ranks that left (their goodbyes end their receives)."""
        failed = 0
        left = []
        entered = dict(change.left_epochs)  # the epoch each one's `last` is numbered in
        for member_id, last in change.left:
            rank = installed.rank_of(member_id)
            if entered.get(member_id, installed.epoch) < installed.epoch:
                last = 0  # it closed before it entered this view: it made none of our calls
            if rank is not None:
                self.limit = min(self.limit, last)
                failed += table.peer_closed(rank, last)
                left.append(rank)
        gone = set(change.lost) | {m.id for m in installed.members if view.rank_of(m.id) is None}
        gone -= {m for m, _ in change.left}
        for member_id in gone:
            rank = installed.rank_of(member_id)
            if rank is not None and rank not in table.closed_after:  # else it left
                self.lost.setdefault(rank, "it was declared dead")
        if self.lost or not change.left:
            self.limit = 0  # a loss (or a renewed epoch): nothing more of it runs
            failed += table.fail_all(lambda call: lost_error(self, links, call))
            if not self.lost:
                self.lost[-1] = "the registry renewed the epoch"
        self.only_left = not self.lost
        self.calls_failed(failed)
        return left


def _lost(broken: Broken | None, links: PeerLinks) -> tuple[dict[int, str], int, str]:
    """(rank -> how it was lost, the broken epoch, the lost members described)."""
    lost = dict(broken.lost) if broken is not None else {}
    epoch = broken.epoch if broken is not None else links.epoch
    view = links.view
    names = "; ".join(
        f"rank {r} ({view.members[r].describe()}): {why}"
        if view is not None and 0 <= r < view.size
        else why
        for r, why in sorted(lost.items())
    )
    return lost, epoch, names


def lost_error(broken: Broken | None, links: PeerLinks, call: Call | None) -> PeerLostError:
    """The error of a call of an epoch that lost members (None: the next call)."""
    lost, epoch, names = _lost(broken, links)
    what = (
        f"collective #{call.cid} {call.fingerprint.describe()}"
        if call is not None and call.cid
        else "this call"
    )
    when = "failed" if call is not None else "did not run"
    return PeerLostError(
        f"{what} {when} on rank {links.rank}: the group of epoch {epoch} lost "
        f"{names or 'a member'}. Inputs are unchanged. The next call runs in the new view "
        "of the survivors (restore and re-synchronise state first: dsml.elastic does it)",
        lost=sorted(r for r in lost if r >= 0),
        rank=links.rank,
        epoch=epoch,
        cid=call.cid if call is not None else None,
        collective=call.fingerprint.collective if call is not None else None,
    )


def sub_group_failure(
    state: ViewState,
    evicted: str | None,
    no_quorum: NoQuorumError | None,
    broken: Broken | None,
    links: PeerLinks,
) -> DsmlError | None:
    """The error a sub-group's call fails with while the root's installed epoch is broken
    (members lost, no quorum, this rank evicted: the root is in `state`); None while it
    is whole. Sub-groups end with their epoch: unlike the root's own calls, theirs never
    move to the survivors' view, so each fails at once instead of waiting for lost peers.
    """
    if state is ViewState.EVICTED:
        return evicted_error(evicted, links, None)
    if state is ViewState.NO_QUORUM:
        return no_quorum_error(no_quorum, links, None)
    if state is not ViewState.MEMBER_LOST:
        return None
    lost, epoch, names = _lost(broken, links)
    return PeerLostError(
        f"a sub-communicator's call did not run on root rank {links.rank}: the "
        f"group of epoch {epoch} lost {names or 'a member'}. Inputs are unchanged. "
        "Sub-communicators end with their epoch: once the survivors' view is in place "
        "(the root communicator's next call moves to it), split again",
        lost=sorted(r for r in lost if r >= 0),
        rank=links.rank,
        epoch=epoch,
    )


def no_quorum_error(
    reason: NoQuorumError | None, links: PeerLinks, call: Call | None
) -> NoQuorumError:
    """The error of a call while this side of a loss is no majority (None: the next)."""
    what = (
        f"collective #{call.cid} {call.fingerprint.describe()} failed on rank {links.rank}: "
        if call is not None and call.cid
        else ""
    )
    return NoQuorumError(
        f"{what}{reason}",
        rank=links.rank,
        epoch=links.epoch,
        cid=call.cid if call is not None else None,
        collective=call.fingerprint.collective if call is not None else None,
    )


def evicted_error(reason: str | None, links: PeerLinks, call: Call | None) -> EvictedError:
    """The error of every call once this rank was evicted (None: the next call)."""
    return EvictedError(
        reason or "this worker was evicted",
        rank=links.rank,
        epoch=links.epoch,
        cid=call.cid if call is not None else None,
        collective=call.fingerprint.collective if call is not None else None,
    )


def no_view_error(
    broken: Broken | None, links: PeerLinks, registry_address: str, view_timeout: float
) -> PeerLostError:
    """The error of a call that waited in vain for the view after a loss."""
    return PeerLostError(
        f"rank {links.rank} lost members of epoch {links.epoch} and no new "
        f"view came from the registry at {registry_address} within "
        f"{view_timeout:g} s: is the registry running?",
        lost=sorted(broken.lost) if broken else (),
        rank=links.rank,
        epoch=links.epoch,
    )


def joined_error(view: View, rank: int) -> MembershipChangedError:
    """The error of the first call after a join when the application asked for it."""
    return MembershipChangedError(
        f"the group changed to {view.size} members at epoch {view.epoch} "
        "(members joined); state must be synchronised again",
        rank=rank,
        epoch=view.epoch,
    )


def changing_error(links: PeerLinks) -> MembershipChangedError:
    """The error of a point-to-point call while a loss's view is not in place yet."""
    return MembershipChangedError(
        f"the group is changing after epoch {links.epoch} lost members; "
        "point-to-point calls resume once the new view is in place (try again)",
        rank=links.rank,
        epoch=links.epoch,
    )


def goodbye_overdue(
    table: CallTable, links: PeerLinks, survival: Survival | None, rank: int, epoch: int
) -> None:
    """The registry said rank left, but its goodbye never came: end its receives."""
    if links.epoch != epoch or rank in table.said_goodbye:
        return  # it came, or that epoch's calls are over
    if survival is None or not survival.stopped:  # closing: no reader left
        log.warning("rank %d left without a goodbye reaching this rank", rank)
    table.peer_messages_ended(rank)
