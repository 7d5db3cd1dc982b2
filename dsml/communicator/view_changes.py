"""Changes of membership as one rank sees them (communicator layer).

The registry's news arrives here (`Listener`), and every collective that cannot start at
once passes `admit()` first. The rules, the same on every rank (docs/faults.md):

- **Loss** (a member died, or was evicted): the epoch's calls in flight fail with
  `PeerLostError`, or, if none was in flight, the next call does (every survivor sees the
  loss once); the call after that runs in the registry's new view as collective #1. A
  dropped connection to a peer counts as a loss at once and is reported to the registry.
- **Leave** (a member closed after collective #last): calls up to #last run; the first
  one after fails (the member closed); the next runs in the new view.
- **Join**: the rank answers the registry's proposal with its next collective id and holds
  calls from there; the registry takes the largest answer as the boundary: calls below it
  run in the old epoch, the one at the boundary waits for them, then runs in the new view.
- **Eviction**: this rank was declared dead; every call fails with `EvictedError`.

`ViewChanges` is one object: what the rank knows (the newest view, agreed joins waiting
for their boundary, the gate a proposal sets, the broken epoch, an eviction, a lack of
quorum) is set in its `__init__` and written only by its methods: the events, then
admitting calls and installing views at a call boundary. It owns two small records
written only by their own methods, a broken epoch's (`Broken`, view_losses.py, beside
the errors calls fail with) and the joins' (`Joins`, view_joins.py); entering a view is
done by plain functions (view_install.py). States and events are named in
`TRANSITIONS` (view_states.py, with a diagram in docs/architecture.md); each handler
records its transition in `history` (tests/unit/test_view_changes.py drives each one).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING

from ..errors import (
    DsmlError,
    EvictedError,
    NoQuorumError,
    PeerLostError,
)
from ..membership import Change, RegistryClient, View
from .call import Call
from .call_table import CallTable
from .links import PeerLinks
from .view_install import announce_view, enter_view
from .view_joins import Joins
from .view_losses import (
    Broken,
    changing_error,
    evicted_error,
    goodbye_overdue,
    joined_error,
    lost_error,
    no_quorum_error,
    no_view_error,
    sub_group_failure,
)
from .view_states import TRANSITIONS, ViewListener, Views, ViewState, transition

if TYPE_CHECKING:
    from .survival import Survival

__all__ = ["TRANSITIONS", "ViewChanges", "ViewListener", "ViewState", "Views"]

log = logging.getLogger("dsml.communicator")

_LOCAL_VERDICT_S = 1.0  # a dropped peer the registry has not ruled on: lost after this
_GOODBYE_WAIT_S = 5.0  # a peer the registry says left, whose goodbye never came: ended then


class ViewChanges:
    """Applies the registry's views to one rank; see the module docstring."""

    def __init__(
        self, table: CallTable, links: PeerLinks, registry: RegistryClient, view_timeout: float
    ) -> None:
        self.table = table
        self.links = links
        self.registry = registry
        self.view_timeout = view_timeout
        self.latest: View | None = links.view  # the newest view the registry sent
        self.interrupt_on_join = False  # elastic: the first call after a join raises
        self.listeners: list[ViewListener] = []
        self.installed = 0
        self._joins = Joins()  # the gate a proposal sets, agreed joins (view_joins.py)
        self._failed_view: View | None = None  # the view that ended the epoch abruptly
        self._broken: Broken | None = None
        self._evicted: str | None = None
        self._no_quorum: NoQuorumError | None = None  # lost without registry and majority
        #: decides losses while the registry is away (`use_survival`)
        self.survival: Survival | None = None
        self._changed = asyncio.Event()
        #: (event, state before, state after) of the latest events, oldest first
        self.history: deque[tuple[str, ViewState, ViewState]] = deque(maxlen=64)
        table.report_departures(self.peer_left)

    def use_survival(self, survival: Survival) -> None:
        """Decide losses with `survival` while the registry is away (the root's)."""
        self.survival = survival

    @property
    def state(self) -> ViewState:
        """The state this rank is in (derived from what it knows; see `TRANSITIONS`)."""
        if self._evicted is not None:
            return ViewState.EVICTED
        if self.links.view is None:
            return ViewState.JOINING
        broken = self._broken
        if broken is not None and broken.epoch == self.links.epoch:
            if self._no_quorum is not None:
                return ViewState.NO_QUORUM
            return ViewState.MEMBER_LEFT if broken.only_left else ViewState.MEMBER_LOST
        if self._joins.agreed:
            return ViewState.JOIN_AGREED
        if self._joins.gate is not None:
            return ViewState.JOIN_PROPOSED
        return ViewState.STEADY

    @property
    def evicted(self) -> bool:
        return self._evicted is not None

    @property
    def no_quorum(self) -> bool:
        return self._no_quorum is not None

    async def _next_change(self) -> None:
        self._changed.clear()
        await self._changed.wait()

    def _wake(self) -> None:
        self._changed.set()

    def _newest_epoch(self) -> int:
        return max(self.links.epoch, self.latest.epoch if self.latest is not None else 0)

    # -- errors (view_losses.py) ------------------------------------------------------------

    def sub_group_error(self) -> DsmlError | None:
        """The error a sub-group's call fails with now (None: none; see view_losses.py)."""
        state, links = self.state, self.links
        return sub_group_failure(state, self._evicted, self._no_quorum, self._broken, links)

    def _lost_error(self, call: Call | None) -> PeerLostError:
        return lost_error(self._broken, self.links, call)

    def _no_quorum_error(self, call: Call | None) -> NoQuorumError:
        return no_quorum_error(self._no_quorum, self.links, call)

    def _evicted_error(self, call: Call | None) -> EvictedError:
        return evicted_error(self._evicted, self.links, call)

    # -- the events --------------------------------------------------------------------------

    @transition("formed")
    def install_first(self, view: View) -> None:
        """Install the view this rank joined with (no calls exist yet)."""
        self.table.enter(view)
        self.links.enter(view)
        self.latest = view

    @transition("view")
    def on_view(self, view: View, change: Change) -> None:
        self._take_view(view, change)

    def _take_view(self, view: View, change: Change) -> None:
        if self._evicted is not None or view.epoch <= self._newest_epoch():
            return
        self.latest = view
        self._no_quorum = None  # a newer view rules
        self.links.announce(view)  # its members' early messages may be held now
        self._joins.drop_proposal()
        if change.boundary is not None and change.previous == self._base()[0]:
            self._joins.agree(change.boundary, view)
        else:
            self._joins.cancel()
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
        return self._joins.renumber(epoch, next_cid)

    @transition("proposal")
    def on_propose(self, epoch: int) -> None:
        if self._evicted is not None:
            return
        broken = self._broken
        if broken is not None and broken.epoch == self.links.epoch and self._failed_view is None:
            return  # the registry's view of the loss is coming: it replaces the proposal
        base, next_cid = self._base()
        self._joins.propose(base, next_cid)
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
        self._joins.drop_proposal()  # the proposal died with the registry that made it
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
            broken = self._broken = Broken(view.epoch, limit=last, owed=True, only_left=True)
        broken.left(last, failed)
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
        broken = self._broken_now(view.epoch)
        broken.lose_majority()
        broken.calls_failed(self.table.fail_all(lambda call: self._no_quorum_error(call)))
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
        broken = self._broken_now(view.epoch)
        broken.lose(rank, "its connection dropped (the process died or closed)")
        broken.calls_failed(self.table.fail_all(self._lost_error))
        self._wake()

    def _break(self, view: View, change: Change) -> None:
        installed = self.links.view
        assert installed is not None
        broken = self._broken
        if broken is None or broken.epoch != installed.epoch:
            broken = self._broken = Broken(installed.epoch, limit=1 << 62, owed=True)
        for rank in broken.take_change(installed, view, change, self.table, self.links):
            # Its goodbye, behind its last messages on its link, ends its receives.
            loop = asyncio.get_running_loop()
            loop.call_later(_GOODBYE_WAIT_S, self._goodbye_overdue, rank, installed.epoch)

    def _goodbye_overdue(self, rank: int, epoch: int) -> None:
        goodbye_overdue(self.table, self.links, self.survival, rank, epoch)

    def _broken_now(self, epoch: int) -> Broken:
        """The record of the installed epoch's loss (made at its first loss)."""
        if self._broken is None or self._broken.epoch != epoch:
            self._broken = Broken(epoch, owed=True)
        return self._broken

    # -- admitting calls, installing views -----------------------------------------------------

    def immediate(self) -> bool:
        """Whether the next collective can start now, with no view work to do first."""
        if self._evicted is not None or self._broken is not None:
            return False
        joins = self._joins
        if not joins.agreed and joins.gate is None:
            return True  # steady, the usual case: no need to look at the call table
        cid = self.table.next_cid
        return joins.due(cid) is None and not joins.holds(self.links.epoch, cid)

    async def admit(self) -> None:
        """Wait until the next collective id may be used; install views on
        the way. Raises the error a call must fail with instead of running."""
        while True:
            if self._evicted is not None:
                raise self._evicted_error(None)
            cid = self.table.next_cid
            broken = self._broken
            if broken is not None and broken.epoch == self.links.epoch:
                if cid <= broken.limit:
                    return
                if self._no_quorum is not None:
                    broken.take_owed()
                    raise self._no_quorum_error(None)
                if broken.take_owed():
                    if not broken.only_left:
                        raise self._lost_error(None)
                    return  # a leave: the call fails at its start (that member closed)
                await self._install(await self._newer_view())
                continue
            joins = self._joins
            view = joins.due(cid)  # _apply takes it off the list
            if view is not None:
                await self._install(view)
                if self.interrupt_on_join:
                    raise joined_error(view, self.links.rank)
                continue
            if joins.holds(self.links.epoch, cid):
                await self._next_change()
                continue
            return

    def ensure_current(self) -> None:
        """For point-to-point calls (no collective id): fail, or move to the new view now.

        After members only left (closed their communicators), point-to-point calls go on
        in the current view: messages sent before a close are still delivered, and a call
        naming a member that closed fails saying so. After a loss the first call fails
        (unless one already did), and the next one moves to the survivors' view.
        """
        if self._evicted is not None:
            raise self._evicted_error(None)
        broken = self._broken
        if broken is None or broken.epoch != self.links.epoch or broken.only_left:
            return
        if broken.take_owed():  # (a loss: the leaves returned above)
            raise self._lost_error(None)
        latest = self._failed_view
        if latest is None or latest.epoch <= self.links.epoch or self.table.calls:
            raise changing_error(self.links)
        self._apply(latest)

    async def _newer_view(self) -> View:
        try:
            async with asyncio.timeout(self.view_timeout):
                while self._failed_view is None or self._failed_view.epoch <= self.links.epoch:
                    if self._evicted is not None:
                        raise self._evicted_error(None)
                    if self._no_quorum is not None:
                        raise self._no_quorum_error(None)
                    await self._next_change()
        except TimeoutError:
            raise no_view_error(
                self._broken, self.links, self.registry.address, self.view_timeout
            ) from None
        return self._failed_view

    async def _install(self, view: View) -> None:
        """Wait for this epoch's calls to end, then install `view`."""
        while self.table.calls:
            tasks = [c.task for c in self.table.calls.values() if c.task is not None]
            if not tasks:
                break
            await asyncio.wait(tasks)
            await asyncio.sleep(0)  # let the calls' done callbacks forget them
        self._apply(view)

    @transition("installed")
    def _apply(self, view: View) -> None:
        old = self.links.view
        assert old is not None
        enter_view(self.table, self.links, old, view)
        self._joins.installed(view)  # the agreed join this install completes
        self.installed += 1
        self._no_quorum = None
        if self._broken is not None and self._broken.epoch < view.epoch:
            self._broken = None
        if self.latest is None or self.latest.epoch < view.epoch:
            self.latest = view
        announce_view(self.registry, self.links, self.listeners, old, view)

    # -- for the application --------------------------------------------------------------------

    def next_view(self) -> View:
        """The view the next collective will run in, as far as this rank knows now."""
        view = self.links.view
        assert view is not None
        broken = self._broken
        if broken is not None:
            after = broken.view_after(view, self._failed_view, self.table.next_cid)
            if after is not None:
                return after
        due = self._joins.due(self.table.next_cid)
        return due if due is not None else view

    def pending_view(self) -> View | None:
        """A newer view known but not installed yet (None if none)."""
        latest = self.latest
        if self._joins.agreed:
            return self._joins.agreed[-1][1]
        if latest is not None and self.links.view is not None and latest.epoch > self.links.epoch:
            return latest
        return None

    async def wait_known(self, timeout: float | None = None) -> View:  # noqa: ASYNC109
        """Wait until a view newer than the installed one is known; returns it."""
        async with asyncio.timeout(timeout):
            while self.pending_view() is None:
                if self._evicted is not None:
                    raise self._evicted_error(None)
                await self._next_change()
        view = self.pending_view()
        assert view is not None
        return view
