"""Changes of membership as one rank sees them (communicator layer).

The registry's news arrives here (`Listener`), and every collective that cannot start at
once passes `admit()` first. The rules, the same on every rank:

- **Loss** (a member died, or was evicted): every call of the epoch in flight fails with
  `PeerLostError`. If none was in flight, the next call fails instead, so that every
  survivor's program sees the loss exactly once. The call after that waits for the
  registry's new view, then runs in it as collective #1.
- **Leave** (a member closed its communicator after collective #last): calls up to #last
  run normally; the first one after fails as before (the member closed), and the next one
  runs in the new view.
- **Join** (agreed with the registry): the registry asks where each member is; the rank
  answers with its next collective id and holds the calls from there on. The registry
  takes the largest answer as the boundary: calls below it run in the old epoch, the one
  at the boundary waits for them to finish, then runs first in the new view. Nothing of
  the old epoch is disturbed.
- **Eviction**: this rank was declared dead (it was silent too long). Every call fails
  with `EvictedError`; the application may join again as a new member.

A dropped connection to a peer (seen by the transport's socket monitor) counts as a loss
here at once and is reported to the registry, which checks it and publishes the new view.

The states a rank can be in and the events that move it are named in `ViewState` and
`TRANSITIONS` (view_states.py; a diagram is in docs/architecture.md). Every event handler
records the transition it made in `history`; a transition the table does not list is a
bug and is logged as an error (tests/unit/test_view_changes.py drives each one).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import EvictedError, MembershipChangedError, NoQuorumError, PeerLostError
from ..membership import Change, RegistryClient, View
from .call import Call
from .call_table import CallTable
from .links import PeerLinks
from .view_states import TRANSITIONS, ViewState, transition

if TYPE_CHECKING:
    from .survival import Survival

__all__ = ["TRANSITIONS", "ViewChanges", "ViewListener", "ViewState"]

log = logging.getLogger("dsml.communicator")

ViewListener = Callable[[View, View], Any]

_LOCAL_VERDICT_S = 1.0  # a dropped peer the registry has not ruled on: lost after this
_GOODBYE_WAIT_S = 5.0  # a peer the registry says left, whose goodbye never came: ended then


@dataclass(slots=True)
class _Broken:
    """The current epoch lost members: who, and up to which collective it still runs."""

    epoch: int
    lost: dict[int, str] = field(default_factory=dict)  # rank -> how it was lost
    limit: int = 0  # calls numbered up to this still run (members that left did them)
    owed: bool = False  # no call failed yet: the next one must
    only_left: bool = False  # members only left (closed): the call table raises their error


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
        self._transitions: list[tuple[int, View]] = []  # agreed joins: (boundary, view)
        self._failed_view: View | None = None  # the view that ended the epoch abruptly
        self._gate: tuple[int, int] | None = None  # (epoch, cid) from which calls wait
        self._broken: _Broken | None = None
        self._evicted: str | None = None
        self._no_quorum: NoQuorumError | None = None  # lost without registry and majority
        #: decides losses while the registry is away (set by `Survival`)
        self.survival: Survival | None = None
        #: told of every newer view known (its members' early messages may be held)
        self.on_announced: Callable[[View], None] = lambda _view: None
        self._changed = asyncio.Event()
        #: (event, state before, state after) of the latest events, oldest first
        self.history: deque[tuple[str, ViewState, ViewState]] = deque(maxlen=64)
        links.on_peer_lost = self.peer_disconnected
        table.on_peer_left = self.peer_left

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
        if self._transitions:
            return ViewState.JOIN_AGREED
        if self._gate is not None:
            return ViewState.JOIN_PROPOSED
        return ViewState.STEADY

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
        self.on_announced(view)
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
        log.warning("rank %d left without a goodbye reaching this rank", rank)
        self.table.peer_messages_ended(rank)

    def _break(self, view: View, change: Change) -> None:
        installed = self.links.view
        assert installed is not None
        broken = self._broken
        if broken is None or broken.epoch != installed.epoch:
            broken = self._broken = _Broken(installed.epoch, limit=1 << 62, owed=True)
        failed = 0
        for member_id, last in change.left:
            rank = installed.rank_of(member_id)
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

    # -- admission ----------------------------------------------------------------------------

    def immediate(self) -> bool:
        """Whether the next collective can start now, with no view work to do first."""
        if self._evicted is not None or self._broken is not None:
            return False
        cid = self.table.next_cid
        if self._transitions and cid >= self._transitions[0][0]:
            return False
        return self._gate is None or (self.links.epoch, cid) < self._gate

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
                    broken.owed = False
                    raise self._no_quorum_error(None)
                if broken.owed:
                    broken.owed = False
                    if not broken.only_left:
                        raise self._lost_error(None)
                    return  # a leave: the call fails at its start (that member closed)
                await self._install(await self._newer_view())
                continue
            if self._transitions and cid >= self._transitions[0][0]:
                _boundary, view = self._transitions[0]  # _apply takes it off the list
                await self._install(view)
                if self.interrupt_on_join:
                    raise MembershipChangedError(
                        f"the group changed to {view.size} members at epoch {view.epoch} "
                        "(members joined); state must be synchronised again",
                        rank=self.links.rank,
                        epoch=view.epoch,
                    )
                continue
            if self._gate is not None and (self.links.epoch, cid) >= self._gate:
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
        if broken.owed and not broken.only_left:
            broken.owed = False
            raise self._lost_error(None)
        latest = self._failed_view
        if latest is None or latest.epoch <= self.links.epoch or self.table.calls:
            raise MembershipChangedError(
                f"the group is changing after epoch {self.links.epoch} lost members; "
                "point-to-point calls resume once the new view is in place (try again)",
                rank=self.links.rank,
                epoch=self.links.epoch,
            )
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
            raise PeerLostError(
                f"rank {self.links.rank} lost members of epoch {self.links.epoch} and no new "
                f"view came from the registry at {self.registry.address} within "
                f"{self.view_timeout:g} s: is the registry running?",
                lost=sorted(self._broken.lost) if self._broken else (),
                rank=self.links.rank,
                epoch=self.links.epoch,
            ) from None
        return self._failed_view

    async def _next_change(self) -> None:
        self._changed.clear()
        await self._changed.wait()

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
        self.table.fail_all(
            lambda call: MembershipChangedError(
                f"recv from rank {call.peer} was pending when the group moved to epoch "
                f"{view.epoch}; point-to-point messages do not cross a change of view",
                rank=self.links.rank,
                epoch=old.epoch,
                collective="recv",
            )
        )
        self.table.enter(view)
        self.links.enter(view)
        if self._transitions and self._transitions[0][1] is view:
            self._transitions.pop(0)  # the agreed join this install completes
        self.installed += 1
        self._no_quorum = None
        if self._broken is not None and self._broken.epoch < view.epoch:
            self._broken = None
        if self.latest is None or self.latest.epoch < view.epoch:
            self.latest = view
        log.info("epoch %d: rank %d of %d", view.epoch, self.links.rank, view.size)
        beacon = self.registry.beacon
        if beacon is not None:
            beacon.beat_now()
        for listener in list(self.listeners):
            try:
                listener(old, view)
            except Exception:
                log.exception("a view listener failed")

    def _wake(self) -> None:
        self._changed.set()

    def _newest_epoch(self) -> int:
        return max(self.links.epoch, self.latest.epoch if self.latest is not None else 0)

    # -- for the application --------------------------------------------------------------------

    def next_view(self) -> View:
        """The view the next collective will run in, as far as this rank knows now."""
        view = self.links.view
        assert view is not None
        broken, failed = self._broken, self._failed_view
        if broken is not None and not broken.only_left and failed is not None:
            return failed if failed.epoch > view.epoch else view
        if (
            broken is not None
            and broken.only_left
            and failed is not None
            and failed.epoch > view.epoch
            and not broken.owed
            and self.table.next_cid > broken.limit
        ):
            return failed  # a leave: the calls of the old view are over here
        if self._transitions and self.table.next_cid >= self._transitions[0][0]:
            return self._transitions[0][1]
        return view

    def pending_view(self) -> View | None:
        """A newer view known but not installed yet (None if none)."""
        latest = self.latest
        if self._transitions:
            return self._transitions[-1][1]
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

    @property
    def evicted(self) -> bool:
        return self._evicted is not None

    @property
    def no_quorum(self) -> bool:
        return self._no_quorum is not None

    # -- errors ---------------------------------------------------------------------------------

    def _lost_error(self, call: Call | None) -> PeerLostError:
        broken = self._broken
        lost = dict(broken.lost) if broken is not None else {}
        epoch = broken.epoch if broken is not None else self.links.epoch
        view = self.links.view
        names = "; ".join(
            f"rank {r} ({view.members[r].describe()}): {why}"
            if view is not None and 0 <= r < view.size
            else why
            for r, why in sorted(lost.items())
        )
        what = (
            f"collective #{call.cid} {call.fingerprint.describe()}"
            if call is not None and call.cid
            else "this call"
        )
        when = "failed" if call is not None else "did not run"
        return PeerLostError(
            f"{what} {when} on rank {self.links.rank}: the group of epoch {epoch} lost "
            f"{names or 'a member'}. Inputs are unchanged. The next call runs in the new view "
            "of the survivors (restore and re-synchronise state first: dsml.elastic does it)",
            lost=sorted(r for r in lost if r >= 0),
            rank=self.links.rank,
            epoch=epoch,
            cid=call.cid if call is not None else None,
            collective=call.fingerprint.collective if call is not None else None,
        )

    def _no_quorum_error(self, call: Call | None) -> NoQuorumError:
        what = (
            f"collective #{call.cid} {call.fingerprint.describe()} failed on rank "
            f"{self.links.rank}: "
            if call is not None and call.cid
            else ""
        )
        return NoQuorumError(
            f"{what}{self._no_quorum}",
            rank=self.links.rank,
            epoch=self.links.epoch,
            cid=call.cid if call is not None else None,
            collective=call.fingerprint.collective if call is not None else None,
        )

    def _evicted_error(self, call: Call | None) -> EvictedError:
        return EvictedError(
            self._evicted or "this worker was evicted",
            rank=self.links.rank,
            epoch=self.links.epoch,
            cid=call.cid if call is not None else None,
            collective=call.fingerprint.collective if call is not None else None,
        )
