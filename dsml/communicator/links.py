"""A worker's links to its peers: endpoint, one channel per peer, inbound routing
(communicator layer).

`PeerLinks` binds the worker's endpoint, keeps a channel to every peer of the installed
view, and is the first to look at every incoming message: it checks that the sender is a
peer of this view and claims its own rank, drops messages of older epochs (counted),
holds messages of a view this rank has not installed yet (only from members of the
current or an announced view, within a budget: `membership.holding`), and passes the rest
to the handler registered for the message's kind (the call table's). Messages from
outside the view are dropped and counted, with one warning line per sender and interval.
Every message from a peer is a sign of life for `watch` (`membership.peerwatch`), which
watches the view's overlay neighbours (and peers that beat this rank). It
knows nothing about calls; sending is FIFO per peer, also when a peer's queue is full.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from ..config import CommConfig
from ..errors import DsmlError, ProtocolError
from ..log import Throttle
from ..membership import View
from ..membership.holding import FutureHold
from ..membership.peerwatch import PeerWatch, overlay
from ..transport import Channel, Endpoint, Sent, tune_malloc
from ..wire import Envelope, Kind
from .tasks import TaskOwner

__all__ = ["Inbound", "LinkEvents", "PeerLinks"]

log = logging.getLogger("dsml.communicator")

#: messages queued per connected peer before ZeroMQ stops reading from it: a flood from
#: one sender (a non-member, say) costs at most this many of its messages in memory, and
#: the other peers' connections are read in turn meanwhile
_PEER_RCVHWM = 1024
_WARN_EVERY_S = 10.0  # one warning line per sender and kind of drop in this interval
_GOODBYE_GRACE_S = 0.05  # a dropped connection may be a goodbye still on its way

_MEMBERSHIP_KINDS = frozenset({Kind.PEER_BEAT, Kind.VIEW_PROPOSAL})

#: what handles one kind of message from a peer: (sender rank, envelope, payload)
Inbound = Callable[[int, Envelope, list[memoryview]], None]


class LinkEvents(Protocol):
    """What the links tell the root communicator (`RootLife`, lifecycle.py)."""

    def peer_lost(self, member_id: str) -> None:
        """A peer's connection dropped without a goodbye."""

    def said_goodbye(self, rank: int) -> bool:
        """Whether peer `rank` said goodbye (a dropped connection then is no loss)."""
        ...

    def membership(self, rank: int, env: Envelope) -> None:
        """A message of the membership protocol between peers (a view proposal)."""

    def bug(self, exc: BaseException) -> None:
        """A bug met while handling a message: the communicator fails."""


class PeerLinks:
    """See the module docstring. `bind`, then `route`, then `enter(view)`."""

    def __init__(self, member_id: str, config: CommConfig, tasks: TaskOwner) -> None:
        self.member_id = member_id
        self.config = config
        self.view: View | None = None
        self.rank = -1
        self.counters: Counter[str] = Counter()
        self.crashed = False  # dsml.testing.crash: as if the process had died
        #: wraps each new peer channel (dsml.testing injects faults with it: `inject`)
        self._wrap: Callable[[str, Channel], Channel] | None = None
        #: whether the data link to a peer (by member id) is cut (dsml.testing injects
        #: partitions with it); the same-host shared-memory path honours it as well
        self.cut: Callable[[str], bool] | None = None
        #: what the links tell the communicator (`listen`); None: nothing, or closed
        self._events: LinkEvents | None = None
        self.watch = PeerWatch(interval=1.0, timeout=10.0)
        self.warnings = Throttle(_WARN_EVERY_S)
        self._hold: FutureHold[tuple[bytes, Envelope, list[memoryview]]] = FutureHold()
        self._member_ids: dict[bytes, str] = {}  # identity -> member id, current view
        self._tasks = tasks
        self._endpoint: Endpoint | None = None
        self._channels: dict[int, Channel] = {}
        self._by_member: dict[str, Channel] = {}
        self._ranks: dict[bytes, int] = {}
        self._backlog: dict[int, int] = {}  # per peer: sends waiting for room
        self._turns: dict[int, asyncio.Lock] = {}
        self._inbound: Mapping[Kind, Inbound] = {}

    # -- setup ------------------------------------------------------------------------------

    def bind(self) -> str:
        """Bind the endpoint; returns the address peers will connect to."""
        if self.config.tune_malloc:
            tune_malloc()
        self._endpoint = Endpoint.bind(
            self.config.bind,
            self._dispatch,
            max_frame_bytes=self.config.max_frame_bytes,
            name="peers",
            curve=self.config.curve,
            rcvhwm=_PEER_RCVHWM,
        )
        return self._endpoint.address

    def route(self, inbound: Mapping[Kind, Inbound]) -> None:
        """Hand each kind of peer message to its handler (the call table's)."""
        self._inbound = inbound

    def enter(self, view: View) -> None:
        """Adopt a view: connect to its new peers, drop the others, and replay what
        arrived early for it. The call table must have entered the view first."""
        rank = view.rank_of(self.member_id)
        assert rank is not None, "a view must contain this member"
        previous = self.epoch
        self.view, self.rank = view, rank
        self._ranks = {m.id.encode(): r for r, m in enumerate(view.members)}
        self._member_ids = {m.id.encode(): m.id for m in view.members if m.id != self.member_id}
        watched = [view.members[peer].id for peer in overlay(view.size, rank)]
        self.watch.reset(watched, time.monotonic())
        self._hold.reset_allowed(self._member_ids.values())
        members = {m.id for m in view.members}
        for member_id in [m for m in self._by_member if m not in members]:
            self._tasks.spawn(self._by_member.pop(member_id).aclose(linger_s=0.0))
        self._channels = {}
        for peer, member in enumerate(view.members):
            if peer != rank:
                self._channels[peer] = self._channel_to(member.id, member.address)
        if previous:
            self._backlog.clear()
            self._turns.clear()
        for sender, env, payload in self._hold.release():
            try:
                self._dispatch(sender, env, payload)
            except ProtocolError as exc:  # one bad early message must not fail the install
                self.counters["dropped_held"] += 1
                self.warnings.warning(
                    log,
                    f"held:{sender[:32]!r}",
                    "dropped a held %s message: %s",
                    env.kind.name,
                    exc,
                )

    def announce(self, view: View) -> None:
        """A view newer than the installed one is known: hold its members' messages too."""
        self._hold.allow(m.id for m in view.members if m.id != self.member_id)

    def _channel_to(self, member_id: str, address: str) -> Channel:
        channel = self._by_member.get(member_id)
        if channel is None:
            channel = Channel.connect(
                address,
                self.member_id.encode(),
                copy_threshold=self.config.zero_copy_min_bytes,
                max_frame_bytes=self.config.max_frame_bytes,
                on_disconnect=functools.partial(self._disconnected, member_id),
                curve=self.config.curve,
            )
            if self._wrap is not None:
                channel = self._wrap(member_id, channel)
            self._by_member[member_id] = channel
        return channel

    def listen(self, events: LinkEvents) -> None:
        """Tell `events` (the root communicator's lifecycle) what happens on the links."""
        self._events = events

    def inject(
        self, wrap: Callable[[str, Channel], Channel] | None, cut: Callable[[str], bool] | None
    ) -> None:
        """Send through `wrap(member_id, channel)` from now on, the channels already open
        included, and cut the links `cut` names (`dsml.testing` injects faults so). With
        `wrap` None, channels opened later are not wrapped (those open stay as they are)."""
        assert self.view is not None
        self._wrap, self.cut = wrap, cut
        if wrap is None:
            return
        for member_id in self._by_member:
            self._by_member[member_id] = wrap(member_id, self._by_member[member_id])
        for peer, member in enumerate(self.view.members):
            if peer != self.rank:
                self._channels[peer] = self._by_member[member.id]

    def _disconnected(self, member_id: str) -> None:
        """A peer's connection dropped: after a moment for its goodbye, report it lost."""
        if self._events is None:
            return

        def check() -> None:
            rank = self.view.rank_of(member_id) if self.view is not None else None
            events = self._events
            if rank is None or events is None or events.said_goodbye(rank):
                return  # it left properly, is no longer a peer, or we closed
            self.counters["disconnects"] += 1
            events.peer_lost(member_id)

        asyncio.get_running_loop().call_later(_GOODBYE_GRACE_S, check)

    @property
    def epoch(self) -> int:
        return self.view.epoch if self.view is not None else 0

    @property
    def size(self) -> int:
        return self.view.size if self.view is not None else 0

    @property
    def dropped(self) -> int:
        """Malformed messages dropped by the endpoint."""
        return self._endpoint.dropped if self._endpoint is not None else 0

    # -- sending ----------------------------------------------------------------------------

    def try_send(self, peer: int, env: Envelope, payload: Sequence[Any] = ()) -> Sent | None:
        """Queue a message now if nothing to that peer is waiting for room; else None."""
        if self._backlog.get(peer):
            return None  # messages wait for room: do not overtake them
        sent = self._channels[peer].send_nowait(env, payload)
        if sent is not None and self.view is not None:
            self.watch.sent(self.view.members[peer].id, time.monotonic())
        return sent

    def send_in_turn(
        self, peer: int, env: Envelope, payload: Sequence[Any] = ()
    ) -> asyncio.Task[Sent]:
        """Queue a message once the messages to that peer before it are queued (FIFO).

        Only needed when the peer's queue was full (a slow or absent peer). The message
        waits in a task of the links, counted at once, so later sends queue behind it
        even before that task has started; a caller that stops waiting does not unsend it.
        """
        self._backlog[peer] = self._backlog.get(peer, 0) + 1
        task = self._tasks.spawn(self._send_in_turn(peer, env, payload), watched=False)
        task.add_done_callback(functools.partial(self._sent_in_turn, peer))
        return task

    def _sent_in_turn(self, peer: int, task: asyncio.Task[Sent]) -> None:
        self._backlog[peer] = self._backlog.get(peer, 1) - 1
        if not task.cancelled() and task.exception() is not None:
            log.warning("a send to rank %d failed: %s", peer, task.exception())

    async def _send_in_turn(self, peer: int, env: Envelope, payload: Sequence[Any]) -> Sent:
        async with self._turns.setdefault(peer, asyncio.Lock()):
            return await self._channels[peer].send(env, payload)

    async def send(self, peer: int, env: Envelope, payload: Sequence[Any] = ()) -> Sent:
        """Queue a message to the peer of that rank, waiting for room if needed."""
        return self.try_send(peer, env, payload) or await self.send_in_turn(peer, env, payload)

    def send_control(self, env: Envelope, peers: Sequence[int] | None = None) -> None:
        """Send a small control message to every peer (or to `peers`), in the background."""
        if self.crashed:
            return
        targets = [p for p in (peers if peers is not None else self._channels) if p != self.rank]
        for peer in targets:
            try:
                if self.try_send(peer, env) is None:
                    self.send_in_turn(peer, env)
            except DsmlError as exc:  # a closed or refused channel: the peer is gone
                log.warning("a %s to rank %d was not sent: %s", env.kind.name, peer, exc)

    # -- inbound ----------------------------------------------------------------------------

    def _dispatch(self, sender: bytes, env: Envelope, payload: list[memoryview]) -> None:
        """The endpoint's reader hands every message here (the only caller)."""
        member = self._member_ids.get(sender)
        if member is not None:
            now = time.monotonic()
            self.watch.heard(member, now)
            if env.kind is Kind.PEER_BEAT:  # it watches us (of any epoch): watch it back
                self.watch.add([member], now)
        if self.view is None or env.epoch > self.epoch:
            self._hold_early(sender, env, payload)
            return
        if env.epoch < self.epoch:
            self.counters["stale"] += 1
            return
        rank = self._ranks.get(sender)
        if rank is None or rank == self.rank:
            self._drop_foreign(sender, env, "not a peer of this view")
            return
        if env.src != rank:
            raise ProtocolError(f"rank {rank} claims to be rank {env.src}")
        if env.kind in _MEMBERSHIP_KINDS:
            if env.kind is Kind.VIEW_PROPOSAL and self._events is not None:
                self._events.membership(rank, env)
            return
        handler = self._inbound.get(env.kind)
        if handler is None:
            raise ProtocolError(f"{env.kind.name} is not a peer-to-peer message")
        try:
            handler(rank, env, payload)
        except ProtocolError:
            raise  # the sender's fault: the endpoint drops the message and counts it
        except Exception as exc:  # our bug: fail the communicator, keep the reader alive
            log.error("handling a %s message failed", env.kind.name, exc_info=exc)
            if self._events is not None:
                self._events.bug(exc)

    def _hold_early(self, sender: bytes, env: Envelope, payload: list[memoryview]) -> None:
        """A message of a view not installed yet: held if its sender may send one."""
        size = sum(p.nbytes for p in payload)
        sender_id = sender.decode(errors="replace")
        if self.view is None:  # joining: the members are not known yet (the budget holds)
            self._hold.allow([sender_id])
        outcome = self._hold.hold(sender_id, size, (sender, env, payload))
        if outcome == "held":
            self.counters["held"] += 1
        elif outcome == "foreign":
            self._drop_foreign(sender, env, f"epoch {env.epoch} from a non-member")
        else:
            self.counters["dropped_over_budget"] += 1
            self.warnings.warning(
                log,
                f"budget:{sender[:32]!r}",
                "dropped a %s message of epoch %d from %r: the budget for messages of a view "
                "not installed yet is full (%d held, %d bytes)",
                env.kind.name,
                env.epoch,
                sender[:32],
                self._hold.frames,
                self._hold.nbytes,
            )

    def _drop_foreign(self, sender: bytes, env: Envelope, why: str) -> None:
        self.counters["dropped_foreign"] += 1
        self.warnings.warning(
            log,
            f"foreign:{sender[:32]!r}",
            "dropped a %s message from %r (%s)",
            env.kind.name,
            sender[:32],
            why,
        )

    @property
    def dropped_total(self) -> int:
        """Messages dropped: malformed, from outside the view, over the holding budget."""
        counters = self.counters
        extra = counters["dropped_foreign"] + counters["dropped_over_budget"]
        return self.dropped + extra + counters["dropped_held"]

    @property
    def held_now(self) -> int:
        """Messages held for a view not installed yet, now."""
        return len(self._hold)

    # -- shutdown ---------------------------------------------------------------------------

    async def crash(self) -> None:
        """Close every socket at once, sending nothing (tests: a process killed)."""
        self.crashed = True
        self._events = None
        await self._close_sockets(linger_s=0.0)
        self.view = None

    def say_goodbye(self, last: int, error: str | None = None) -> None:
        """Tell the peers this rank closes after collective `last` (and why, if it failed)."""
        if self.view is not None:
            body: dict[str, Any] = {"last": last}
            if error is not None:
                body["error"] = error[:2048]
            self.send_control(Envelope(Kind.GOODBYE, self.epoch, self.rank, body=body))

    async def aclose(self) -> None:
        """Close every socket (the communicator has flushed the background sends)."""
        self._events = None
        await self._close_sockets(linger_s=1.0)

    async def _close_sockets(self, linger_s: float) -> None:
        for channel in self._by_member.values():
            await channel.aclose(linger_s=linger_s)
        self._channels.clear()
        self._by_member.clear()
        if self._endpoint is not None:
            await self._endpoint.aclose()

    def __repr__(self) -> str:
        return (
            f"<PeerLinks rank={self.rank}/{self.size} epoch={self.epoch} "
            f"peers={len(self._channels)} held={len(self._hold)} dropped={self.dropped} "
            f"{dict(self.counters)}>"
        )
