"""The events that change one rank's view of membership (communicator layer).

`ViewEvents` handles the registry's news (a new view, a proposal to admit joiners, this
rank's eviction, the registry coming back), the transport's (a peer's connection
dropped), the call table's (a peer said goodbye) and the survivors' (a view agreed
without the registry, no quorum). Each handler records its transition (`transition`,
view_states.py). A loss fails the calls in flight at once; views are installed later, at
a call boundary (view_admission.py).
"""

from __future__ import annotations

import asyncio
import logging

from ..errors import NoQuorumError
from ..membership import Change, View
from .view_base import ViewBase, _Broken
from .view_states import transition

__all__ = ["ViewEvents"]

log = logging.getLogger("dsml.communicator")

_LOCAL_VERDICT_S = 1.0  # a dropped peer the registry has not ruled on: lost after this
_GOODBYE_WAIT_S = 5.0  # a peer the registry says left, whose goodbye never came: ended then


class ViewEvents(ViewBase):
    """The handlers of membership events; see the module docstring."""

    @transition("formed")
    def install_first(self, view: View) -> None:
        """Install the view this rank joined with (no calls exist yet)."""
        self.table.enter(view)
        self.links.enter(view)
        self.latest = view

    # -- the registry's news ------------------------------------------------------------------

    @transition("view")
    def on_view(self, view: View, change: Change) -> None:
        self._take_view(view, change)

    def _take_view(self, view: View, change: Change) -> None:
        if self._evicted is not None or view.epoch <= self._newest_epoch():
            return
        self.latest = view
        self._no_quorum = None  # a newer view rules
        self.links.announce(view)  # its members' early messages may be held now
        self._gate = None
        if change.boundary is not None and change.previous == self._base()[0]:
            self._transitions.append((change.boundary, view))
        else:
            self._transitions.clear()
            self._failed_view = view
            self._break(view, change)
        self._wake()

    def _base(self) -> tuple[int, int]:
        """(epoch, next collective id) of the last view this rank has agreed to enter."""
        broken, failed = self._broken, self._failed_view
        if broken is not None and broken.epoch == self.links.epoch and failed is not None:
            epoch, next_cid = failed.epoch, 1
        else:
            epoch, next_cid = self.links.epoch, self.table.next_cid
        for boundary, view in self._transitions:  # count in the numbering of the last one
            epoch, next_cid = view.epoch, max(next_cid, boundary) - boundary + 1
        return epoch, next_cid

    @transition("proposal")
    def on_propose(self, epoch: int) -> None:
        if self._evicted is not None:
            return
        broken = self._broken
        if broken is not None and broken.epoch == self.links.epoch and self._failed_view is None:
            return  # the registry's view of the loss is coming: it replaces the proposal
        base, next_cid = self._base()
        self._gate = (base, next_cid)
        self.registry.ready(epoch, next_cid)

    @transition("evicted")
    def on_evicted(self, epoch: int, reason: str) -> None:
        if self._evicted is not None or epoch <= self.links.epoch:
            return
        self._evicted = (
            f"this worker was evicted from the group at epoch {epoch}: {reason}. Its calls "
            "cannot run; join again as a new member (dsml.init, or dsml.elastic.run does it)"
        )
        log.warning("%s", self._evicted)
        self.registry.stop_heartbeats()
        self.table.fail_all(lambda call: self._evicted_error(call))
        self._wake()

    @transition("registry back")
    def on_reregister(self) -> None:
        self._gate = None  # the proposal died with the registry that made it
        if self.survival is not None:
            self.survival.registry_back()
        self._wake()

    def peer_disconnected(self, member_id: str) -> None:
        """The transport saw a peer's connection drop without a goodbye."""
        view = self.links.view
        rank = view.rank_of(member_id) if view is not None else None
        if view is None or rank is None or self._evicted is not None:
            return
        log.warning("lost the connection to rank %d (%s)", rank, member_id)
        self.registry.suspect(member_id, view.epoch)
        # The registry answers within milliseconds when it runs; without it, give up the
        # calls with that peer after a while anyway (its goodbye may also still come).
        loop = asyncio.get_running_loop()
        loop.call_later(_LOCAL_VERDICT_S, self._lost_locally, member_id, view.epoch)

    @transition("peer left")
    def peer_left(self, rank: int, last: int, failed: int) -> None:
        """A peer said goodbye after collective `last`: the first call after it fails (once,
        with MemberLeftError, unless one in flight already did), the next waits for the
        view without it. Without the registry, the survivors agree on that view."""
        view = self.links.view
        if view is None or self._evicted is not None or not 0 <= rank < view.size:
            return
        broken = self._broken
        if broken is None or broken.epoch != view.epoch:
            broken = self._broken = _Broken(view.epoch, limit=last, owed=True, only_left=True)
        broken.limit = min(broken.limit, last)
        broken.owed = broken.owed and not failed
        self._wake()
        survival = self.survival
        if survival is not None and not survival.registry_heard():
            survival.peers_lost([view.members[rank].id], "left")

    @transition("agreed")
    def on_agreed(self, view: View, lost: list[str]) -> None:
        """The survivors agreed on `view` without the registry: apply it like its view."""
        installed = self.links.view
        if installed is None:
            return
        self._take_view(view, Change(previous=installed.epoch, lost=tuple(lost)))

    @transition("no quorum")
    def on_no_quorum(self, error: NoQuorumError) -> None:
        """Members were lost while the registry is away and this side is no majority."""
        view = self.links.view
        if view is None or self._evicted is not None:
            return
        self._no_quorum = error
        if self._broken is None or self._broken.epoch != view.epoch:
            self._broken = _Broken(view.epoch, owed=True)
        self._broken.only_left = False
        self._broken.lost.setdefault(-1, "no majority of the group is reachable")
        failed = self.table.fail_all(lambda call: self._no_quorum_error(call))
        self._broken.owed = self._broken.owed and not failed
        self._wake()

    @transition("peer dropped")
    def _lost_locally(self, member_id: str, epoch: int) -> None:
        view = self.links.view
        rank = view.rank_of(member_id) if view is not None else None
        if view is None or rank is None or view.epoch != epoch or self._evicted is not None:
            return  # a new view came, or this rank left
        if self.survival is not None and self.survival.stopped:
            return  # this rank is closing
        failed = self._failed_view
        if rank in self.table.closed_after or (failed is not None and failed.epoch > epoch):
            return  # it said goodbye after all, or the registry's verdict is in
        log.warning("no word from the registry: giving up the calls with rank %d", rank)
        if self.survival is not None:
            self.survival.peers_lost([member_id], "disconnected")
        if self._broken is None or self._broken.epoch != view.epoch:
            self._broken = _Broken(view.epoch, owed=True)
        self._broken.only_left = False
        self._broken.lost[rank] = "its connection dropped (the process died or closed)"
        gave_up = self.table.fail_all(self._lost_error)
        self._broken.owed = self._broken.owed and not gave_up
        self._wake()

    def _goodbye_overdue(self, rank: int, epoch: int) -> None:
        """The registry said rank left, but its goodbye never came: end its receives."""
        if self.links.epoch != epoch or rank in self.table.said_goodbye:
            return  # it came, or that epoch's calls are over
        if self.survival is None or not self.survival.stopped:  # closing: no reader left
            log.warning("rank %d left without a goodbye reaching this rank", rank)
        self.table.peer_messages_ended(rank)

    def _break(self, view: View, change: Change) -> None:
        installed = self.links.view
        assert installed is not None
        broken = self._broken
        if broken is None or broken.epoch != installed.epoch:
            broken = self._broken = _Broken(installed.epoch, limit=1 << 62, owed=True)
        failed = 0
        entered = dict(change.left_epochs)  # the epoch each one's `last` is numbered in
        for member_id, last in change.left:
            rank = installed.rank_of(member_id)
            if entered.get(member_id, installed.epoch) < installed.epoch:
                last = 0  # it closed before it entered this view: it made none of our calls
            if rank is not None:
                broken.limit = min(broken.limit, last)
                failed += self.table.peer_closed(rank, last)
                # Its goodbye, behind its last messages on its link, ends its receives.
                loop = asyncio.get_running_loop()
                loop.call_later(_GOODBYE_WAIT_S, self._goodbye_overdue, rank, installed.epoch)
        gone = set(change.lost) | {m.id for m in installed.members if view.rank_of(m.id) is None}
        gone -= {m for m, _ in change.left}
        for member_id in gone:
            rank = installed.rank_of(member_id)
            if rank is not None and rank not in self.table.closed_after:  # else it left
                broken.lost.setdefault(rank, "it was declared dead")
        if broken.lost or not change.left:
            broken.limit = 0  # a loss (or a renewed epoch): nothing more of it runs
            failed += self.table.fail_all(self._lost_error)
            if not broken.lost:
                broken.lost[-1] = "the registry renewed the epoch"
        broken.only_left = not broken.lost
        broken.owed = broken.owed and not failed
