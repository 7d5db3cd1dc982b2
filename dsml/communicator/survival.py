"""Going on without the registry: peers watching each other, survivors agreeing on a view
(communicator layer; the rules are in `membership.peerwatch` and `membership.agreement`).

`Survival` runs one task per communicator that, every half heartbeat interval:

- sends a `PeerBeat` to every watched peer whose link carried nothing for an interval, so
  that a silent link means a stopped, cut-off or dead peer (`PeerWatch`); the watched
  peers are the view's overlay neighbours (`peerwatch.overlay`: a few ring successors
  and predecessors), so the beats per member do not grow with the group, plus, while
  survivors agree without the registry, every peer not lost (for the round, all pairs:
  a partitioned or stopped peer outside the overlay counts as lost after one more
  timeout instead of being waited for, and a member still agreeing is heard by those
  that decided first);
- credits its own stalls (the loop did not run) to every peer;
- names the peers silent for the heartbeat timeout.

A peer lost (silent, or its connection dropped with no verdict from the registry within a
second) is handled by who can decide:

- The registry is reachable (it acknowledged a heartbeat within half the timeout): a silent
  peer is reported to it (`Suspect`); a strict majority of reports drops it, and the
  cut-off rank, if it still hears the registry, is told it was dropped. If the registry
  then goes away without ruling (it died just before the peer), the survivors agree on
  the peers they reported as soon as it counts as away.
- The registry is away: the survivors agree on the successor view among themselves
  (`VIEW_PROPOSAL` messages, `Agreement`). A decided view is installed like a view of the
  registry (the calls in flight fail once with `PeerLostError`, the next runs in the new
  view, ranks renumbered in ring order) and reported to the registry (`ViewAgreed`), which
  adopts it when it is back. A side that is no strict majority of the view may not go on:
  its calls fail with `NoQuorumError` until the registry rules; meanwhile it asks the
  registry every interval to renew the epoch (a `Suspect` naming itself), which settles a
  healed partition in one more epoch, or drops this side if the others went on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from ..errors import NoQuorumError
from ..membership import RegistryClient, View
from ..membership.agreement import Agreement, digest
from ..membership.liveness import StallDetector
from ..wire import Envelope, Fields, Kind
from .links import PeerLinks
from .tasks import TaskOwner

__all__ = ["Survival", "SurvivorViews"]

log = logging.getLogger("dsml.communicator")


class SurvivorViews(Protocol):
    """What survival asks and tells the rank's view machine (`ViewChanges`)."""

    @property
    def evicted(self) -> bool: ...
    @property
    def no_quorum(self) -> bool: ...
    def on_agreed(self, view: View, lost: list[str]) -> None: ...
    def on_no_quorum(self, error: NoQuorumError) -> None: ...


class Survival:
    """See the module docstring. `start()` once the first view is installed."""

    def __init__(
        self,
        links: PeerLinks,
        views: SurvivorViews,
        registry: RegistryClient,
        tasks: TaskOwner,
    ) -> None:
        self.links = links
        self.views = views
        self.registry = registry
        self.tasks = tasks
        self.agreement: Agreement | None = None
        self.reported: set[str] = set()  # silent peers reported to the registry, this epoch
        self._epoch = 0
        self._task: asyncio.Task[None] | None = None
        self.stopped = False

    def start(self) -> None:
        self._task = self.tasks.spawn(self._run())

    def stop(self) -> None:
        """Stop watching (closing): the task never ends by itself."""
        self.stopped = True
        if self._task is not None:
            self._task.cancel()

    # -- the watch ------------------------------------------------------------------------

    def _settings(self) -> tuple[float, float]:
        interval, timeout = self.registry.heartbeat_interval, self.registry.heartbeat_timeout
        watch = self.links.watch
        if (watch.interval, watch.timeout) != (interval, timeout):
            # New settings (a registry restarted with others): a full timeout from now.
            watch.interval, watch.timeout = interval, timeout
            now = time.monotonic()
            for peer in watch.last_heard:
                watch.heard(peer, now)
        return interval, timeout

    async def _run(self) -> None:
        interval, _timeout = self._settings()
        stall = StallDetector(interval / 2, tolerance=interval / 2)
        stall.tick(time.monotonic())
        while True:
            await asyncio.sleep(self._settings()[0] / 2)
            now = time.monotonic()
            late = stall.tick(now)
            if late:
                self.links.watch.credit(late)
            self.tick(now)

    def tick(self, now: float) -> None:
        """One round of the watch (also called by tests)."""
        view = self.links.view
        if view is None or self.stopped or self.links.crashed or self.views.evicted:
            return
        if view.epoch != self._epoch:
            self._epoch, self.agreement, self.reported = view.epoch, None, set()
        agreement = self.agreement
        if agreement is not None and agreement.decided is None:
            # All pairs while agreeing: hear those this member waits for (else a stopped or
            # cut-off one would be waited for forever), and be heard by those that decide
            # first, whose new view expects to hear from this member.
            skip = {*agreement.direct, self.links.member_id}
            peers = [m.id for m in agreement.previous.members if m.id not in skip]
            self.links.watch.add(peers, now)
        self._beat(now)
        silent = self.links.watch.silent(now)
        if silent:
            self.peers_lost(silent, "silent")
        if self.reported and not self.registry_heard():
            # Reported to a registry that then went away without ruling (it died just
            # before them): agree on them now, not once their links are silent for the
            # whole heartbeat timeout.
            # Not yet this member's own suspicions (`direct`): a peer's proposal may have
            # put them in the lost set already, on its word, which would leave this
            # member waiting for their own proposals (they are dead) until the silence.
            known = self.agreement.direct if self.agreement is not None else frozenset()
            waiting = sorted(m for m in self.reported if m not in known)
            if waiting:
                self.peers_lost(waiting, "reported to the registry, which went away")
        if self.views.no_quorum and self.registry_heard():
            self.registry.suspect(self.links.member_id, view.epoch)  # "renew my epoch"

    def _beat(self, now: float) -> None:
        links = self.links
        view = links.view
        assert view is not None
        for member in links.watch.due(now):
            peer = view.rank_of(member)
            if peer is not None and peer != links.rank:
                links.try_send(peer, Envelope(Kind.PEER_BEAT, view.epoch, links.rank))

    def registry_back(self) -> None:
        """The registry restarted (this member just sent it its view): report again the
        peers reported to the one before, which never ruled on them. Else the new one kept
        them for its whole restart grace (a full heartbeat timeout) while nobody reported
        them again."""
        view = self.links.view
        if view is None or self.stopped or self.views.evicted:
            return
        for member in sorted(self.reported):
            if view.rank_of(member) is not None:
                self.registry.suspect(member, view.epoch)

    def registry_heard(self) -> bool:
        """Whether the registry acknowledged this member lately: within half the heartbeat
        timeout (it acknowledges every heartbeat, and beats come at least twice as often)."""
        return self.registry.registry_silent_for() <= self.registry.heartbeat_timeout / 2

    # -- losses ---------------------------------------------------------------------------

    def peers_lost(self, members: list[str], how: str) -> None:
        """These peers are silent, or dropped their connection without a verdict."""
        view = self.links.view
        if view is None or self.stopped or self.views.evicted:
            return
        members = [m for m in members if view.rank_of(m) is not None]
        if self.registry_heard() and self.agreement is None:
            for member in members:
                if member not in self.reported:
                    self.reported.add(member)
                    log.warning(
                        "rank %d (%s) is %s: reporting it to the registry",
                        view.rank_of(member),
                        member,
                        how,
                    )
                    self.registry.suspect(member, view.epoch)
            return
        agreement = self._agreement(view)
        if agreement.suspect(members) or agreement.sent is None:
            log.warning(
                "without the registry: lost %s of epoch %d (%s); agreeing with the others",
                sorted(agreement.lost),
                view.epoch,
                how,
            )
            self._propose(agreement)
        self._decide(agreement)

    def _agreement(self, view: View) -> Agreement:
        if self.agreement is None or self.agreement.previous.epoch != view.epoch:
            self.agreement = Agreement(view, self.links.member_id)
        return self.agreement

    def _propose(self, agreement: Agreement) -> None:
        view = agreement.previous
        if self.links.view is not view:
            return  # a newer view is installed: this round is over
        body = {"lost": sorted(agreement.proposal())}
        env = Envelope(Kind.VIEW_PROPOSAL, view.epoch, self.links.rank, body=body)
        peers = [r for r, m in enumerate(view.members) if m.id not in agreement.direct]
        self.links.send_control(env, [p for p in peers if p != self.links.rank])

    def handle_message(self, rank: int, env: Envelope) -> None:
        """A peer's `ViewProposal` (the links route it here)."""
        view = self.links.view
        if view is None or self.stopped or self.views.evicted:
            return
        lost = Fields(env.body, "ViewProposal").get_str_list("lost", view.size)
        agreement = self._agreement(view)
        grew = agreement.receive(view.members[rank].id, env.epoch, lost)
        if grew or agreement.sent is None:
            self._propose(agreement)
        self._decide(agreement)

    def _decide(self, agreement: Agreement) -> None:
        decided = agreement.decided
        if decided is not None:
            lost = sorted(agreement.lost)
            log.warning(
                "the survivors of epoch %d agreed on epoch %d without the registry: %d "
                "members (view %s; lost %s)",
                agreement.previous.epoch,
                decided.epoch,
                decided.size,
                digest(decided),
                lost,
            )
            self.registry.agreed(decided, agreement.previous.epoch, lost)
            self.views.on_agreed(decided, lost)
            return
        direct = agreement.direct
        if not agreement.quorate and direct:
            # Those this member lost by its own detection already leave no majority.
            try:
                agreement.check_quorum()
            except NoQuorumError as exc:  # delivered to the calls
                self.views.on_no_quorum(exc)

    def __repr__(self) -> str:
        return f"<Survival epoch={self._epoch} {self.agreement!r} reported={len(self.reported)}>"
