"""The registry server: joins, liveness, views and epochs (membership layer).

The registry is not on the data path: it only tells members who their peers are. It binds
one endpoint; members connect a channel whose identity is their member id, and a heartbeat
thread whose identity is the member id plus `.hb`.

- Forming: ranks are given in join order, except that members asking for a rank (as
  `dsml run` does) get it. When `world_size` members have joined, the group forms at a new
  epoch and every member gets the view.
- Liveness: a member silent for `heartbeat_timeout` is declared dead. A member whose peer
  connection dropped, or went silent, reports it (SUSPECT); the registry checks that the
  suspect's own connection to the registry is gone too, and declares it dead at once if
  so. A member that most of the others report (a strict majority of them) is cut off from
  the group and dropped even if it still reaches the registry. A member that
  was declared dead and comes back is told it was evicted.
- Views: every change of membership makes a view with a higher epoch, ranks renumbered
  0..n-1 in the previous ring order. A loss or a leave ends the old epoch at once. Joiners
  to a running group are admitted at a boundary the members agree on: the registry asks
  every member for its next collective id (PROPOSE/READY); the largest is the boundary.
- Restarts: a registry that hears heartbeats from members it does not know asks them for
  their view (REREGISTER/REJOIN) and adopts the newest; nobody is evicted before a full
  heartbeat timeout has passed since the restart.
- Away: the registry being unreachable is not the members being dead (`liveness`). Silent
  members are evicted only when they cannot be a group of their own (no strict majority of
  the view, or disconnected); a registry that was stopped (SIGSTOP, a hung host) credits
  the time it did not run to everyone and, after a long stall, re-learns the members as
  after a restart. Survivors of a loss that happened meanwhile agree on a view among
  themselves (`agreement`) and report it (VIEW_AGREED, or REJOIN when asked about a
  heartbeat from a newer epoch); the registry adopts it if it descends from its own view
  (a subset, in the same ring order).

Malformed messages are dropped and counted; the registry keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._opener import Opener
from ..config import RegistryConfig
from ..errors import ConfigError, ProtocolError
from ..transport import Endpoint, check_address
from ..wire import Envelope, Fields, Kind
from .liveness import Liveness, StallDetector, evictable
from .pool import WorkerPool
from .view import Change, Member, View

__all__ = ["Registry", "open_registry"]

log = logging.getLogger("dsml.registry")

_MAX_WORLD = 1 << 16
_MAX_EVICTED = 4096
_SUSPECT_CHECKS_S = (0.02, 0.05, 0.1, 0.2, 0.4)  # delays of the re-checks of a suspect
_HB = b".hb"
_LAST_WORDS_S = 0.05  # after a connection is gone, time to read what it sent before


@dataclass(frozen=True, slots=True)
class _Joiner:
    member: Member
    world_size: int
    wanted_rank: int | None


@dataclass(slots=True)
class _Proposal:
    view: View  # the view proposed (current members, then the joiners)
    joined: tuple[str, ...]
    ready: dict[str, int] = field(default_factory=dict)  # member id -> its next cid


class Registry:
    """A running registry; see the module docstring. Open with `open_registry`."""

    def __init__(self, config: RegistryConfig) -> None:
        self.config = config
        self._endpoint: Endpoint | None = None
        self._closed = asyncio.Event()
        self.undelivered = 0  # replies dropped: the peer was gone or did not read
        self.views_published = 0
        self._joining: dict[str, _Joiner] = {}  # forming the first view
        self._pending: dict[str, Member] = {}  # asking to join the running group
        self._proposal: _Proposal | None = None
        self._view: View | None = None
        self._change = Change()
        self._epoch = 0
        self._live: dict[str, Liveness] = {}
        self._evicted: dict[str, int] = {}  # member id -> epoch that dropped it
        self._suspects: set[str] = set()  # being checked
        self._reports: dict[str, set[str]] = {}  # suspect -> members that lost it, this epoch
        self._reports_from = 0.0  # reports before this (queued while it was away) are old
        self.pool = WorkerPool()  # worker daemons waiting for jobs (`dsml worker`)
        self._started_at = time.monotonic()
        self.stalls = 0  # times the registry found it had not run for a while
        self.kept_silent = 0  # watchdog rounds that kept silent members (no quorum heard)
        self.adopted = 0  # views agreed by survivors without the registry, adopted
        self._tasks: set[asyncio.Task[Any]] = set()
        self._window: asyncio.TimerHandle | None = None
        self._handlers: dict[Kind, Callable[[bytes, Envelope], None]] = {
            Kind.JOIN_REQUEST: self.handle_join_request,
            Kind.LEAVE_REQUEST: self.handle_leave_request,
            Kind.STATUS_REQUEST: self.handle_status_request,
            Kind.HEARTBEAT: self.handle_heartbeat,
            Kind.SUSPECT: self.handle_suspect,
            Kind.READY: self.handle_ready,
            Kind.REJOIN: self.handle_rejoin,
            Kind.VIEW_AGREED: self.handle_view_agreed,
            Kind.WORKER_HELLO: self.handle_worker_hello,
            Kind.WORKER_BYE: self.handle_worker_bye,
        }

    async def _start(self) -> Registry:
        self._endpoint = Endpoint.bind(
            self.config.address,
            self._dispatch,
            max_frame_bytes=self.config.max_message_bytes,
            max_envelope_bytes=self.config.max_message_bytes,
            name="registry",
            curve=self.config.curve,
        )
        self._started_at = time.monotonic()
        self._spawn(self._watchdog())
        log.info("registry serving on %s", self._endpoint.address)
        return self

    @property
    def address(self) -> str:
        assert self._endpoint is not None, "registry is not open"
        return self._endpoint.address

    @property
    def view(self) -> View | None:
        """The current group, or None while it is forming."""
        return self._view

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def dropped_messages(self) -> int:
        """Malformed or unexpected messages dropped so far."""
        return self._endpoint.dropped if self._endpoint is not None else 0

    async def wait_closed(self) -> None:
        await self._closed.wait()

    async def aclose(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._window is not None:
            self._window.cancel()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2.0)
        if self._endpoint is not None:
            await self._endpoint.aclose()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- dispatch ---------------------------------------------------------------------------

    def _dispatch(self, sender: bytes, env: Envelope, payload: list[memoryview]) -> None:
        handler = self._handlers.get(env.kind)
        if handler is None:
            raise ProtocolError(f"the registry does not accept {env.kind.name}")
        if payload:
            raise ProtocolError(f"{env.kind.name} carries no payload frames")
        handler(sender, env)

    def _reply(self, identity: bytes, kind: Kind, body: dict[str, Any] | None = None) -> None:
        assert self._endpoint is not None
        if not self._endpoint.send_nowait(identity, Envelope(kind, self._epoch, body=body)):
            self.undelivered += 1
            log.info("could not deliver %s to %r (gone, or not reading)", kind.name, identity[:32])

    def _member_of(self, sender: bytes) -> str:
        if sender.endswith(_HB):
            raise ProtocolError("only heartbeats come from a heartbeat identity")
        return sender.decode(errors="replace")

    # -- joining ----------------------------------------------------------------------------

    def handle_join_request(self, sender: bytes, env: Envelope) -> None:
        fields = Fields(env.body, "JoinRequest")
        member = Member.from_wire(fields.get_map("member"))
        world_size = fields.get_int("world_size", 1, _MAX_WORLD)
        wanted = fields.get_int("rank", 0, _MAX_WORLD, optional=True)
        if sender != member.id.encode():
            raise ProtocolError("JoinRequest identity does not match its member id")
        if self._view is not None and self._view.rank_of(member.id) is not None:
            self._send_view(member.id, self._view, Change(previous=self._view.epoch))  # a retry
            return
        if member.id in self._evicted:
            self._reply(sender, Kind.JOIN_REJECTED, {"reason": "this member id was evicted"})
            return
        reason = self._join_refusal(member, world_size, wanted)
        if reason:
            log.warning("refused %s: %s", member.describe(), reason)
            self._reply(sender, Kind.JOIN_REJECTED, {"reason": reason})
            return
        accepted = self._settings()
        if self._view is not None:  # a running group: admit at an agreed boundary
            self._pending[member.id] = member
            accepted |= {"joined": len(self._pending), "world_size": self._view.size}
            self._reply(sender, Kind.JOIN_ACCEPTED, accepted | {"running": True})
            self._schedule_proposal()
            return
        self._joining[member.id] = _Joiner(member, world_size, wanted)
        accepted |= {"joined": len(self._joining), "world_size": world_size}
        self._reply(sender, Kind.JOIN_ACCEPTED, accepted | {"running": False})
        if len(self._joining) == world_size:
            self._form_group(world_size)

    def _join_refusal(self, member: Member, world_size: int, wanted: int | None) -> str:
        try:
            check_address(member.address, "member address")
        except ConfigError as exc:
            return str(exc)
        if self._view is not None:
            return ""  # joins a running group: its size and rank are the group's business
        others = [j for j in self._joining.values() if j.member.id != member.id]
        if others and others[0].world_size != world_size:
            return (
                f"this registry is forming a group of world_size={others[0].world_size}, "
                f"but this member asked for world_size={world_size}"
            )
        if wanted is not None and wanted >= world_size:
            return f"rank {wanted} is out of range for world_size={world_size}"
        if wanted is not None and any(j.wanted_rank == wanted for j in others):
            return f"rank {wanted} was already taken by another member"
        return ""

    def _form_group(self, world_size: int) -> None:
        joiners = list(self._joining.values())
        ranks: list[Member | None] = [None] * world_size
        for joiner in joiners:
            if joiner.wanted_rank is not None:
                ranks[joiner.wanted_rank] = joiner.member
        free = iter(j.member for j in joiners if j.wanted_rank is None)
        members = tuple(m if m is not None else next(free) for m in ranks)
        self._joining.clear()
        log.info("forming a group of %d", world_size)
        self._publish(members, Change(joined=tuple(m.id for m in members)))

    def _schedule_proposal(self) -> None:
        if self._window is None and self._proposal is None:
            loop = asyncio.get_running_loop()
            self._window = loop.call_later(self.config.join_window, self._propose)

    def _propose(self) -> None:
        """Ask the members where they are, to admit the pending joiners after that."""
        self._window = None
        if self._proposal is not None or not self._pending or self._view is None:
            return
        joined = tuple(self._pending)
        view = View(self._epoch + 1, self._view.members + tuple(self._pending.values()))
        self._proposal = _Proposal(view, joined)
        log.info("proposing epoch %d admitting %d joiner(s)", view.epoch, len(joined))
        for member in self._view.members:
            self._reply(member.id.encode(), Kind.PROPOSE, {"epoch": view.epoch})

    def handle_ready(self, sender: bytes, env: Envelope) -> None:
        fields = Fields(env.body, "Ready")
        epoch = fields.get_int("epoch", 1)
        next_cid = fields.get_int("next_cid", 1)
        proposal = self._proposal
        if proposal is None or epoch != proposal.view.epoch or self._view is None:
            return  # an answer to a proposal a failure replaced
        member_id = self._member_of(sender)
        if self._view.rank_of(member_id) is None:
            return
        proposal.ready[member_id] = next_cid
        if len(proposal.ready) == self._view.size:
            self._commit(proposal)

    def _commit(self, proposal: _Proposal) -> None:
        self._proposal = None
        joined = [m for m in proposal.joined if m in self._pending]
        for member_id in joined:
            del self._pending[member_id]
        boundary = max(proposal.ready.values())
        assert self._view is not None
        newcomers = tuple(m for m in proposal.view.members if m.id in joined)
        change = Change(previous=self._epoch, boundary=boundary, joined=tuple(joined))
        self._publish(self._view.members + newcomers, change)
        if self._pending:
            self._schedule_proposal()

    # -- publishing -------------------------------------------------------------------------

    def _publish(self, members: tuple[Member, ...], change: Change) -> None:
        """Make the next view of `members` and send it to each of them."""
        now = time.monotonic()
        if not members:
            log.info("epoch %d ended: no members left; ready for a new group", self._epoch)
            self._view = None
            self._live.clear()
            self._proposal = None
            return
        self._epoch += 1
        change = Change(
            previous=change.previous,
            boundary=change.boundary,
            lost=change.lost,
            left=change.left,
            joined=change.joined,
            heartbeat_interval=self.config.heartbeat_interval,
            heartbeat_timeout=self.config.heartbeat_timeout,
        )
        self._view = View(self._epoch, members)
        self._change = change
        self._reports.clear()
        self.views_published += 1
        for member in members:
            self._live.setdefault(member.id, Liveness(last_seen=now, view_sent=now))
        for gone in [m for m in self._live if self._view.rank_of(m) is None]:
            del self._live[gone]
        log.info(
            "epoch %d: %d members (lost %s, left %s, joined %d)",
            self._epoch,
            len(members),
            list(change.lost),
            [m for m, _ in change.left],
            len(change.joined),
        )
        for member in members:
            self._send_view(member.id, self._view, change)

    def _send_view(self, member_id: str, view: View, change: Change) -> None:
        self._reply(member_id.encode(), Kind.VIEW_CHANGED, view.to_wire() | change.to_wire())

    def _remove(self, lost: list[str], left: list[tuple[str, int]], reason: str) -> None:
        """End the current epoch without the given members; pending joiners come in too."""
        assert self._view is not None
        gone = set(lost) | {m for m, _ in left}
        survivors = tuple(m for m in self._view.members if m.id not in gone)
        for member_id in lost:
            self._evicted[member_id] = self._epoch + 1
            self._reply(
                member_id.encode(), Kind.EVICTED, {"epoch": self._epoch + 1, "reason": reason}
            )
        while len(self._evicted) > _MAX_EVICTED:
            del self._evicted[next(iter(self._evicted))]
        self._proposal = None  # the members' answers refer to the epoch that just ended
        joiners = tuple(self._pending.values()) if survivors else ()
        self._pending = {} if survivors else self._pending
        change = Change(
            previous=self._epoch,
            lost=tuple(lost),
            left=tuple(left),
            joined=tuple(m.id for m in joiners),
        )
        (log.warning if lost else log.info)("epoch %d ends: %s", self._epoch, reason)
        self._publish(survivors + joiners, change)
        if self._pending:
            self._schedule_proposal()

    # -- leaving ----------------------------------------------------------------------------

    def handle_leave_request(self, sender: bytes, env: Envelope) -> None:
        member_id = self._member_of(sender)
        fields = Fields(env.body, "LeaveRequest")
        last = fields.get_int("last", 0, optional=True) or 0
        if self._joining.pop(member_id, None) is not None:
            return
        if self._pending.pop(member_id, None) is not None:
            return
        if self._view is None or self._view.rank_of(member_id) is None:
            return
        self._remove([], [(member_id, last)], f"member {member_id} left")

    # -- liveness ---------------------------------------------------------------------------

    def handle_heartbeat(self, sender: bytes, env: Envelope) -> None:
        if not sender.endswith(_HB):
            raise ProtocolError("a heartbeat must come from a heartbeat identity")
        member_id = sender[: -len(_HB)].decode(errors="replace")
        fields = Fields(env.body, "Heartbeat")
        epoch = fields.get_int("epoch")
        started = _progress(fields, "started")
        finished = _progress(fields, "finished")
        counters = _counters(env.body)
        live = self._live.get(member_id)
        if live is not None:
            now = time.monotonic()
            live.last_seen = now
            live.epoch, live.started, live.finished = epoch, started, finished
            live.counters = counters
            live.beats += 1
            self._reply(member_id.encode(), Kind.HEARTBEAT_ACK, {"epoch": self._epoch})
            if self._view is None:
                return
            if epoch > self._view.epoch and now - live.asked_view > self.config.heartbeat_interval:
                # The survivors agreed on a view while this registry was away: ask for it.
                live.asked_view = now
                self._reply(member_id.encode(), Kind.REREGISTER, self._settings())
            elif (
                epoch < self._view.epoch
                and now - live.view_sent > 2 * self.config.heartbeat_interval
            ):
                # It may never have got the view (its channel was reconnecting): again.
                live.view_sent = now
                self._send_view(member_id, self._view, self._change)
        elif member_id in self._evicted:
            evicted_at = self._evicted[member_id]
            self._reply(
                member_id.encode(),
                Kind.EVICTED,
                {"epoch": evicted_at, "reason": "it was declared dead (silent for too long)"},
            )
        elif epoch > 0 and member_id not in self._pending and member_id not in self._joining:
            self._reply(member_id.encode(), Kind.REREGISTER, self._settings())  # a restart

    def _settings(self) -> dict[str, Any]:
        return {
            "heartbeat_interval": self.config.heartbeat_interval,
            "heartbeat_timeout": self.config.heartbeat_timeout,
        }

    async def _watchdog(self) -> None:
        """Declare dead the members silent for longer than the heartbeat timeout (see
        `liveness`: only with a majority heard, and never for the registry's own stall)."""
        period = min(self.config.heartbeat_interval, self.config.heartbeat_timeout / 4)
        stall = StallDetector(period, tolerance=period / 2)
        stall.tick(time.monotonic())
        while True:
            await asyncio.sleep(period)
            late = stall.tick(time.monotonic())
            if late:
                self._stalled(late)
            for name in self.pool.expire(self.config.heartbeat_timeout):
                log.warning("worker %s stopped sending heartbeats; no longer listed", name)
            self._evict_silent()

    def _stalled(self, late: float) -> None:
        """The registry did not run for `late` seconds: that silence is not the members'."""
        self.stalls += 1
        for live in self._live.values():
            live.last_seen += late
        if late > self.config.heartbeat_timeout / 2:
            log.warning(
                "the registry did not run for %.1f s (stopped, or its host hung); "
                "re-learning the members before anyone can be declared dead",
                late,
            )
            self._started_at = time.monotonic()  # a full timeout of grace, as after a restart
            self._reports_from = self._started_at + self.config.heartbeat_timeout

    def _evict_silent(self) -> None:
        if self._view is None:
            return
        now = time.monotonic()
        if now < self._started_at + self.config.heartbeat_timeout:
            return
        assert self._endpoint is not None
        endpoint = self._endpoint
        silent, kept = evictable(
            [m.id for m in self._view.members],
            self._live,
            now,
            self.config.heartbeat_timeout,
            lambda member: endpoint.reachable(member.encode(), Envelope(Kind.PING)),
        )
        if kept:
            self.kept_silent += 1
            if self.kept_silent == 1 or self.kept_silent % 50 == 0:
                log.warning(
                    "no heartbeat from %s for %g s, but they are a majority of the group "
                    "and still connected: the registry may be the one cut off, and they may "
                    "run on without it, so nobody is evicted for it",
                    ", ".join(kept),
                    self.config.heartbeat_timeout,
                )
        if silent:
            self._remove(
                silent,
                [],
                f"no heartbeat from {', '.join(silent)} for {self.config.heartbeat_timeout:g} s",
            )

    def handle_suspect(self, sender: bytes, env: Envelope) -> None:
        fields = Fields(env.body, "Suspect")
        suspect = fields.get_str("member", 64)
        epoch = fields.get_int("epoch")
        reporter = self._member_of(sender)
        view = self._view
        if view is None or epoch > self._epoch or view.rank_of(reporter) is None:
            return
        if view.rank_of(suspect) is None:
            return  # already gone
        if epoch == self._epoch and suspect != reporter and time.monotonic() >= self._reports_from:
            reporters = self._reports.setdefault(suspect, set())
            reporters.add(reporter)
            if 2 * len(reporters) > view.size - 1:
                # Most of the group lost its links to it: cut off from the group, even if
                # it still reaches the registry (the data path is what it is for).
                self._remove(
                    [suspect],
                    [],
                    f"member {suspect} is cut off from the group ({len(reporters)} of "
                    f"{view.size - 1} members lost their links to it)",
                )
                return
        if suspect in self._suspects:
            return  # being checked (a report about an older epoch may still be news)
        self._suspects.add(suspect)
        self._spawn(self._check_suspect(suspect, self._epoch, reporter))

    async def _check_suspect(self, suspect: str, epoch: int, reporter: str) -> None:
        """Declare `suspect` dead if its own connection to the registry is gone too.

        A process that died closes every connection at once; the registry's may just be
        noticed a moment later than the peer's, hence a few re-checks. A suspect still
        connected after them is alive: the epoch is renewed with the same members, so the
        reporter, which gave up its calls with that peer, can go on.
        """
        assert self._endpoint is not None
        try:
            for delay in (0.0, *_SUSPECT_CHECKS_S):
                await asyncio.sleep(delay)
                if self._view is None or self._view.rank_of(suspect) is None:
                    return  # removed meanwhile (left, or found dead another way)
                if not self._endpoint.reachable(suspect.encode(), Envelope(Kind.PING)):
                    # Its last messages (a LeaveRequest) may still wait in our queue: the
                    # connection can be gone before the reader got to them.
                    await asyncio.sleep(_LAST_WORDS_S)
                    if self._view is None or self._view.rank_of(suspect) is None:
                        return  # it left properly
                    self._remove(
                        [suspect],
                        [],
                        f"member {suspect} disconnected (reported by {reporter})",
                    )
                    return
            if self._view is not None and self._epoch == epoch:  # else a new view went out
                log.warning("member %s is still connected; renewing epoch %d", suspect, epoch)
                self._publish(self._view.members, Change(previous=self._epoch))
        finally:
            self._suspects.discard(suspect)

    # -- restarts ---------------------------------------------------------------------------

    def handle_rejoin(self, sender: bytes, env: Envelope) -> None:
        """A member reports its view: the registry restarted, or the member is at a newer
        epoch than the registry (its survivors agreed on a view while it was away)."""
        member_id = self._member_of(sender)
        view = View.from_wire(Fields(env.body, "Rejoin").get_map("view"))
        if view.rank_of(member_id) is None:
            raise ProtocolError("Rejoin: the view does not list its sender")
        self._adopt(member_id, view, "as its members report it")

    def handle_view_agreed(self, sender: bytes, env: Envelope) -> None:
        """Survivors agreed on `view` without the registry: adopt it if it descends from
        the registry's own view."""
        member_id = self._member_of(sender)
        fields = Fields(env.body, "ViewAgreed")
        view = View.from_wire(fields.get_map("view"))
        if view.rank_of(member_id) is None:
            raise ProtocolError("ViewAgreed: the view does not list its sender")
        self._adopt(member_id, view, "agreed by the survivors while the registry was away")

    def _adopt(self, member_id: str, view: View, how: str) -> None:
        now = time.monotonic()
        current = self._view
        if current is None or view.epoch > self._epoch:
            if current is not None and not _descends(current, view):
                # Not a successor of ours (a member of some other history): it is not ours.
                self._reply(
                    member_id.encode(),
                    Kind.EVICTED,
                    {"epoch": self._epoch, "reason": "its view is not one of this group's"},
                )
                return
            self._take(view, how, now)
        elif view.epoch < self._epoch or current.rank_of(member_id) is None:
            self._reply(
                member_id.encode(),
                Kind.EVICTED,
                {"epoch": self._epoch, "reason": "the group moved on"},
            )
            return
        elif view.members != current.members:
            # Same epoch, other members: the registry published its own view meanwhile.
            # One more epoch, of the members both views share, settles it for everyone.
            lost = [m.id for m in current.members if view.rank_of(m.id) is None]
            self._remove(lost, [], f"settling two views of epoch {view.epoch}")
            return
        live = self._live.get(member_id)
        if live is not None:
            live.last_seen = now
            live.epoch = max(live.epoch, view.epoch)

    def _take(self, view: View, how: str, now: float) -> None:
        """Make `view` the registry's view as it is (same epoch: members already run it)."""
        previous = self._view
        lost = [m.id for m in previous.members if view.rank_of(m.id) is None] if previous else []
        log.warning(
            "adopting epoch %d of %d members, %s%s",
            view.epoch,
            view.size,
            how,
            f" (without {', '.join(lost)})" if lost else "",
        )
        self.adopted += 1 if previous is not None else 0
        self._view, self._epoch = view, view.epoch
        self._reports.clear()
        self._proposal = None  # answers to a proposal refer to an epoch that is over
        self._change = Change(
            previous=previous.epoch if previous else view.epoch,
            lost=tuple(lost),
            heartbeat_interval=self.config.heartbeat_interval,
            heartbeat_timeout=self.config.heartbeat_timeout,
        )
        self._live = {m.id: Liveness(last_seen=now, view_sent=now) for m in view.members}
        self._started_at = now  # a full timeout of grace for everyone to report in
        # Reports of silent peers queued while the registry was away describe a past
        # that the adopted view already settled: they only get the connection check.
        self._reports_from = now + self.config.heartbeat_timeout
        for member_id in lost:
            self._evicted[member_id] = view.epoch
            reason = f"the other members went on without it at epoch {view.epoch}"
            self._reply(member_id.encode(), Kind.EVICTED, {"epoch": view.epoch, "reason": reason})
        if previous is not None:
            for member in view.members:  # stragglers learn it; the others ignore it
                self._send_view(member.id, view, self._change)
        if self._pending:
            self._schedule_proposal()

    # -- worker daemons ---------------------------------------------------------------------

    def handle_worker_hello(self, sender: bytes, env: Envelope) -> None:
        record = self.pool.hello(env.body)
        log.debug("worker %s at %s is %s", record.name, record.address, record.state)

    def handle_worker_bye(self, sender: bytes, env: Envelope) -> None:
        self.pool.bye(env.body)

    # -- status -----------------------------------------------------------------------------

    def handle_status_request(self, sender: bytes, env: Envelope) -> None:
        self._reply(sender, Kind.STATUS_REPLY, self.status())

    def status(self) -> dict[str, Any]:
        """What `dsml status` shows: members with their health and progress, joiners."""
        view = self._view
        now = time.monotonic()
        members = []
        for rank, member in enumerate(view.members if view else ()):
            live = self._live.get(member.id)
            members.append(
                member.to_wire()
                | {
                    "rank": rank,
                    "epoch": live.epoch if live else 0,
                    "heartbeat_age": round(now - live.last_seen, 3) if live else None,
                    "heartbeats": live.beats if live else 0,
                    "started": live.started if live else None,
                    "finished": live.finished if live else None,
                    "counters": dict(live.counters) if live else {},
                }
            )
        return {
            "epoch": self._epoch,
            "formed": view is not None,
            "members": members,
            "joining": [j.member.to_wire() for j in self._joining.values()]
            + [m.to_wire() for m in self._pending.values()],
            "world_size": view.size if view else self._target_size(),
            "evicted": list(self._evicted)[-16:],
            "workers": self.pool.listing(),
            "heartbeat_interval": self.config.heartbeat_interval,
            "heartbeat_timeout": self.config.heartbeat_timeout,
            "views_published": self.views_published,
            "dropped_messages": self.dropped_messages,
            "undelivered_replies": self.undelivered,
            "stalls": self.stalls,
            "views_adopted": self.adopted,
        }

    def _target_size(self) -> int:
        return next(iter(self._joining.values())).world_size if self._joining else 0

    def __repr__(self) -> str:
        state = f"epoch={self._epoch} size={self._view.size}" if self._view else "forming"
        address = self._endpoint.address if self._endpoint else "unbound"
        return (
            f"<Registry {address} {state} joining={len(self._joining) + len(self._pending)} "
            f"dropped={self.dropped_messages}>"
        )


def _descends(old: View, new: View) -> bool:
    """Whether `new` keeps only members of `old`, in `old`'s ring order."""
    ranks = [old.rank_of(m.id) for m in new.members]
    return None not in ranks and ranks == sorted(ranks)  # type: ignore[type-var]


def _counters(body: Any) -> dict[str, int]:
    """A heartbeat's message counters (held, dropped, ...): a small map of counts."""
    raw = body.get("counters") if isinstance(body, dict) else None
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > 16:
        raise ProtocolError("Heartbeat.counters must be a map of at most 16 counts")
    for key, number in raw.items():
        if type(key) is not str or len(key) > 32 or type(number) is not int or number < 0:
            raise ProtocolError("Heartbeat.counters maps short names to counts")
    return dict(raw)


def _progress(fields: Fields, key: str) -> list[Any] | None:
    """A heartbeat's [epoch, cid, description] of a collective, or None."""
    value = fields.get_list(key, 3, optional=True)
    if value is None:
        return None
    if len(value) != 3 or type(value[0]) is not int or type(value[1]) is not int:
        raise ProtocolError(f"Heartbeat.{key} must be [epoch, cid, description]")
    if type(value[2]) is not str or len(value[2]) > 256:
        raise ProtocolError(f"Heartbeat.{key} description must be a short string")
    return list(value)


def open_registry(
    address: str = "tcp://127.0.0.1:0", *, config: RegistryConfig | None = None
) -> Opener[Registry]:
    """Start a registry on address (port 0: the OS chooses; read `registry.address`).

    Use `async with dsml.open_registry() as registry:` or `registry = await
    dsml.open_registry()` followed by `await registry.aclose()`.
    """
    if config is None:
        config = RegistryConfig(address=address)

    async def start() -> Registry:
        return await Registry(config)._start()

    return Opener(start)
