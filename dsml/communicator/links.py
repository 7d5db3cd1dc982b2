"""A worker's links to its peers: endpoint, one channel per peer, inbound routing
(communicator layer).

`PeerLinks` binds the worker's endpoint, keeps a channel to every peer of the installed
view, and is the first to look at every incoming message: it checks that the sender is a
peer of this view and claims its own rank, drops messages of older epochs (counted),
holds messages of a view this rank has not installed yet (within a budget), and passes
the rest to the handler registered for the message's kind (the call table's). It knows
nothing about calls; sending is FIFO per peer, also when a peer's queue is full.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..config import CommConfig
from ..errors import DsmlError, ProtocolError
from ..membership import View
from ..transport import Channel, Endpoint, Sent, tune_malloc
from ..wire import Envelope, Kind
from .tasks import TaskOwner

__all__ = ["Inbound", "PeerLinks"]

log = logging.getLogger("dsml.communicator")

_MAX_HELD = 10_000  # messages of a view not seen yet ...
_MAX_HELD_BYTES = 256 << 20  # ... and their payload bytes
_GOODBYE_GRACE_S = 0.05  # a dropped connection may be a goodbye still on its way

#: what handles one kind of message from a peer: (sender rank, envelope, payload)
Inbound = Callable[[int, Envelope, list[memoryview]], None]


class PeerLinks:
    """See the module docstring. `bind`, then `route`, then `enter(view)`."""

    def __init__(self, member_id: str, config: CommConfig, tasks: TaskOwner) -> None:
        self.member_id = member_id
        self.config = config
        self.view: View | None = None
        self.rank = -1
        self.counters: Counter[str] = Counter()
        self.crashed = False  # dsml.testing.crash: as if the process had died
        #: wraps each new peer channel (dsml.testing injects faults with it)
        self.wrap_channel: Callable[[str, Channel], Channel] | None = None
        #: called with a peer's member id when its connection dropped without a goodbye
        self.on_peer_lost: Callable[[str], None] | None = None
        #: whether a peer said goodbye (a dropped connection then is no loss)
        self.said_goodbye: Callable[[int], bool] = lambda _rank: False
        #: told about a bug met while handling a message (the communicator fails)
        self.on_bug: Callable[[BaseException], None] = lambda _exc: None
        self._tasks = tasks
        self._endpoint: Endpoint | None = None
        self._channels: dict[int, Channel] = {}
        self._by_member: dict[str, Channel] = {}
        self._ranks: dict[bytes, int] = {}
        self._held: list[tuple[bytes, Envelope, list[memoryview]]] = []
        self._held_bytes = 0
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
        held, self._held, self._held_bytes = self._held, [], 0
        for sender, env, payload in held:
            self._dispatch(sender, env, payload)

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
            if self.wrap_channel is not None:
                channel = self.wrap_channel(member_id, channel)
            self._by_member[member_id] = channel
        return channel

    def rewrap(self) -> None:
        """Apply `wrap_channel` to the channels already open."""
        assert self.wrap_channel is not None
        assert self.view is not None
        for member_id in self._by_member:
            self._by_member[member_id] = self.wrap_channel(member_id, self._by_member[member_id])
        for peer, member in enumerate(self.view.members):
            if peer != self.rank:
                self._channels[peer] = self._by_member[member.id]

    def _disconnected(self, member_id: str) -> None:
        """A peer's connection dropped: after a moment for its goodbye, report it lost."""
        if self.on_peer_lost is None:
            return

        def check() -> None:
            rank = self.view.rank_of(member_id) if self.view is not None else None
            if rank is None or self.said_goodbye(rank) or self.on_peer_lost is None:
                return  # it left properly, or is no longer a peer
            self.counters["disconnects"] += 1
            self.on_peer_lost(member_id)

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
        return self._channels[peer].send_nowait(env, payload)

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
        if self.view is None or env.epoch > self.epoch:
            self._hold(sender, env, payload)
            return
        if env.epoch < self.epoch:
            self.counters["stale"] += 1
            return
        rank = self._ranks.get(sender)
        if rank is None or rank == self.rank:
            raise ProtocolError(f"{env.kind.name} from {sender[:32]!r}, not a peer of this view")
        if env.src != rank:
            raise ProtocolError(f"rank {rank} claims to be rank {env.src}")
        handler = self._inbound.get(env.kind)
        if handler is None:
            raise ProtocolError(f"{env.kind.name} is not a peer-to-peer message")
        try:
            handler(rank, env, payload)
        except ProtocolError:
            raise  # the sender's fault: the endpoint drops the message and counts it
        except Exception as exc:  # our bug: fail the communicator, keep the reader alive
            log.error("handling a %s message failed", env.kind.name, exc_info=exc)
            self.on_bug(exc)

    def _hold(self, sender: bytes, env: Envelope, payload: list[memoryview]) -> None:
        size = sum(p.nbytes for p in payload)
        if len(self._held) >= _MAX_HELD or self._held_bytes + size > _MAX_HELD_BYTES:
            raise ProtocolError("too many messages for a view this rank has not seen")
        self._held.append((sender, env, payload))
        self._held_bytes += size
        self.counters["held"] += 1

    # -- shutdown ---------------------------------------------------------------------------

    async def crash(self) -> None:
        """Close every socket at once, sending nothing (tests: a process killed)."""
        self.crashed = True
        self.on_peer_lost = None
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
        self.on_peer_lost = None
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
            f"peers={len(self._channels)} held={len(self._held)} dropped={self.dropped} "
            f"{dict(self.counters)}>"
        )
