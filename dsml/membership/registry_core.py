"""The registry's state and how views go out (membership layer).

`RegistryCore` holds what the registry knows: the view and epoch, members forming the
first group or asking to join a running one, each member's liveness, evictions, reports
of suspect peers, the worker daemons' pool. It also has the steps its roles share:
replying to a member, publishing the next view to its members, ending an epoch without
some members, and proposing to admit joiners at an agreed boundary. The roles that act on
this state are `RegistryJoins` (registry_joins.py), `RegistryLiveness`
(registry_liveness.py) and `RegistryRestarts` (registry_restarts.py); `Registry`
(registry.py) puts them together behind one endpoint.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ..config import RegistryConfig
from ..errors import ProtocolError
from ..transport import Endpoint
from ..wire import Envelope, Kind
from .live import ViewLog
from .liveness import Liveness
from .pool import WorkerPool
from .view import Change, Member, View

__all__ = ["RegistryCore"]

log = logging.getLogger("dsml.registry")

_MAX_EVICTED = 4096
_HB = b".hb"


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


class RegistryCore:
    """The registry's state and the steps its roles share; see the module docstring."""

    def __init__(self, config: RegistryConfig) -> None:
        self.config = config
        self._endpoint: Endpoint | None = None
        self._closed = asyncio.Event()
        self.undelivered = 0  # replies dropped: the peer was gone or did not read
        self.views_published = 0
        self._joining: dict[str, _Joiner] = {}  # forming a group (or waiting to: one runs)
        self._pending: dict[str, Member] = {}  # asking to join the running group
        #: members of the running group that left it by closing (not lost): their seats are
        #: not free for a worker that waits with the job's world_size (see RegistryJoins)
        self._left_seats = 0
        self._proposal: _Proposal | None = None
        self._view: View | None = None
        self._change = Change()
        self._epoch = 0
        self.view_log = ViewLog()  # the last views, with why (`status()`)
        self._live: dict[str, Liveness] = {}
        self._evicted: dict[str, int] = {}  # member id -> epoch that dropped it
        #: the last joins refused since a group last formed, with why (`status()`: a member
        #: whose group never forms tells from them that its peers were turned away)
        self._refused: collections.deque[str] = collections.deque(maxlen=8)
        self._suspects: set[str] = set()  # being checked
        self._removing: set[str] = set()  # lost, removed together in a moment (liveness)
        self._batch: dict[str, str] | None = None  # ... decided so far: member -> reason
        self._reports: dict[str, set[str]] = {}  # suspect -> members that lost it, this epoch
        self._reports_from = 0.0  # reports before this (queued while it was away) are old
        self.pool = WorkerPool()  # worker daemons waiting for jobs (`dsml worker`)
        self._started_at = time.monotonic()
        self.stalls = 0  # times the registry found it had not run for a while
        self.kept_silent = 0  # watchdog rounds that kept silent members (no quorum heard)
        self.adopted = 0  # views agreed by survivors without the registry, adopted
        self._tasks: set[asyncio.Task[Any]] = set()
        self._window: asyncio.TimerHandle | None = None

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _reply(self, identity: bytes, kind: Kind, body: dict[str, Any] | None = None) -> None:
        assert self._endpoint is not None
        if not self._endpoint.send_nowait(identity, Envelope(kind, self._epoch, body=body)):
            self.undelivered += 1
            log.info("could not deliver %s to %r (gone, or not reading)", kind.name, identity[:32])

    def _member_of(self, sender: bytes) -> str:
        if sender.endswith(_HB):
            raise ProtocolError("only heartbeats come from a heartbeat identity")
        return sender.decode(errors="replace")

    def _settings(self) -> dict[str, Any]:
        return {
            "heartbeat_interval": self.config.heartbeat_interval,
            "heartbeat_timeout": self.config.heartbeat_timeout,
        }

    # -- publishing -------------------------------------------------------------------------

    def _publish(self, members: tuple[Member, ...], change: Change, reason: str = "") -> None:
        """Make the next view of `members` and send it to each of them (`reason`: why,
        for `status()`; without it, the change says)."""
        now = time.monotonic()
        if not members:
            log.info("epoch %d ended: no members left; ready for a new group", self._epoch)
            self.view_log.add(self._epoch, 0, change, reason or "no members left")
            self._view = None
            self._left_seats = 0
            self._live.clear()
            self._proposal = None
            self._admit_waiting()
            return
        self._epoch += 1
        change = Change(
            previous=change.previous,
            boundary=change.boundary,
            lost=change.lost,
            left=change.left,
            left_epochs=change.left_epochs,
            joined=change.joined,
            heartbeat_interval=self.config.heartbeat_interval,
            heartbeat_timeout=self.config.heartbeat_timeout,
        )
        self._view = View(self._epoch, members)
        self._change = change
        self.view_log.add(self._epoch, len(members), change, reason)
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
        self._admit_waiting()

    def _admit_waiting(self) -> None:
        """Hook: joiners waiting for a change of view (see RegistryJoins)."""

    def _send_view(self, member_id: str, view: View, change: Change) -> None:
        self._reply(member_id.encode(), Kind.VIEW_CHANGED, view.to_wire() | change.to_wire())

    def _remove(
        self,
        lost: list[str],
        left: list[tuple[str, int]],
        reason: str,
        *,
        left_epochs: dict[str, int] | None = None,
    ) -> None:
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
        self._left_seats += len(left)
        joiners = tuple(self._pending.values()) if survivors else ()
        self._pending = {} if survivors else self._pending
        change = Change(
            previous=self._epoch,
            lost=tuple(lost),
            left=tuple(left),
            left_epochs=tuple((left_epochs or {}).items()),
            joined=tuple(m.id for m in joiners),
        )
        (log.warning if lost else log.info)("epoch %d ends: %s", self._epoch, reason)
        self._publish(survivors + joiners, change, reason)
        if self._pending:
            self._schedule_proposal()

    # -- proposing joins --------------------------------------------------------------------

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
