"""The data plane of one worker: endpoint, peer channels and inbound routing (communicator).

The mesh binds the worker's endpoint, connects a channel to every peer of the current
view, and is the one place that looks at incoming messages. Its reader (the endpoint's)
routes each message by `(epoch, cid, sender rank, lane)` into the mailbox and, on the way,
checks the sender's fingerprint against the call this rank has made under that id: a
mismatch fails the call at once and aborts it everywhere. Stale epochs are dropped and
counted; messages of a view this rank has not seen yet are held until it arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from ..collectives.group import Lane
from ..config import CommConfig
from ..errors import CollectiveAbortedError, CollectiveError, CollectiveMismatchError, ProtocolError
from ..membership import View
from ..transport import Channel, Endpoint, Mailbox, Sent, tune_malloc
from ..wire import Envelope, Fields, Kind
from .call import Call
from .diagnose import abort_body, error_from_abort, goodbye_message, mismatch_message

__all__ = ["PEER_LEFT", "Mesh"]

log = logging.getLogger("dsml.communicator")

_MAX_HELD = 10_000  # messages of a view not seen yet ...
_MAX_HELD_BYTES = 256 << 20  # ... and their payload bytes
_MAX_AHEAD = 1 << 20  # how far past our newest call a peer's collective id may be
_LANES = {Kind.CHUNK: Lane.DATA, Kind.CONFIRM: Lane.CONFIRM}
_GOODBYE_GRACE_S = 0.05  # a dropped connection may be a goodbye still on its way

Item = tuple[Envelope, list[memoryview]]
T = TypeVar("T")

#: Queued behind a closed peer's last point-to-point messages: receiving it means "no more".
PEER_LEFT = Envelope(Kind.GOODBYE)


class Mesh:
    """See the module docstring. `bind` first, then `set_view`."""

    def __init__(self, member_id: str, config: CommConfig) -> None:
        self.member_id = member_id
        self.config = config
        self.view: View | None = None
        self.rank = -1
        self.mailbox: Mailbox[Item] = Mailbox()
        self.calls: dict[tuple[int, int], Call] = {}
        self.receives: set[Call] = set()  # point-to-point receives in flight
        self.next_cid = 1
        self.counters: Counter[str] = Counter()
        self.closed_after: dict[int, int] = {}
        self.left_with_error: dict[int, str] = {}
        self.crashed = False  # dsml.testing.crash: as if the process had died
        #: wraps each new peer channel (dsml.testing injects faults with it)
        self.wrap_channel: Callable[[str, Channel], Channel] | None = None
        self.started: tuple[int, int, str] | None = None  # (epoch, cid, what): heartbeats
        self.finished: tuple[int, int, str] | None = None  # ... report these two
        #: called with a peer's member id when its connection dropped without a goodbye
        self.on_peer_lost: Callable[[str], None] | None = None
        self._endpoint: Endpoint | None = None
        self._channels: dict[int, Channel] = {}
        self._by_member: dict[str, Channel] = {}
        self._ranks: dict[bytes, int] = {}
        self._aborts: dict[int, Envelope] = {}
        self._held: list[tuple[bytes, Envelope, list[memoryview]]] = []
        self._held_bytes = 0
        self._probing: set[tuple[int, int]] = set()
        self._background: set[asyncio.Task[Any]] = set()
        self._backlog: dict[int, int] = {}  # per peer: sends waiting for room
        self._turns: dict[int, asyncio.Lock] = {}
        self._handlers: dict[Kind, Callable[[int, Envelope, list[memoryview]], None]] = {
            Kind.CHUNK: self.handle_chunk,
            Kind.CONFIRM: self.handle_chunk,
            Kind.ABORT: self.handle_abort,
            Kind.PROBE: self.handle_probe,
            Kind.PROGRESS: self.handle_progress,
            Kind.GOODBYE: self.handle_goodbye,
            Kind.PEER_MESSAGE: self.handle_peer_message,
        }

    # -- setup ------------------------------------------------------------------------------

    def bind(self) -> str:
        """Bind the endpoint; returns the address peers will connect to."""
        if self.config.tune_malloc:
            tune_malloc()
        self._endpoint = Endpoint.bind(
            self.config.bind,
            self._dispatch,
            max_frame_bytes=self.config.max_frame_bytes,
            name="mesh",
            curve=self.config.curve,
        )
        return self._endpoint.address

    def set_view(self, view: View) -> None:
        """Adopt a view: connect to its new peers, drop the others, forget what belonged
        to the previous epoch, and replay what arrived early for this one.

        Calls of the previous epoch must be over (the communicator waits for them).
        """
        rank = view.rank_of(self.member_id)
        assert rank is not None, "a view must contain this member"
        previous = self.epoch
        self.view, self.rank = view, rank
        self.next_cid = 1
        self._ranks = {m.id.encode(): r for r, m in enumerate(view.members)}
        members = {m.id for m in view.members}
        for member_id in [m for m in self._by_member if m not in members]:
            self.spawn(self._by_member.pop(member_id).aclose(linger_s=0.0))
        self._channels = {}
        for peer, member in enumerate(view.members):
            if peer == rank:
                continue
            channel = self._by_member.get(member.id)
            if channel is None:
                channel = Channel.connect(
                    member.address,
                    self.member_id.encode(),
                    copy_threshold=self.config.zero_copy_min_bytes,
                    max_frame_bytes=self.config.max_frame_bytes,
                    on_disconnect=functools.partial(self._disconnected, member.id),
                    curve=self.config.curve,
                )
                if self.wrap_channel is not None:
                    channel = self.wrap_channel(member.id, channel)
                self._by_member[member.id] = channel
            self._channels[peer] = channel
        if previous:
            self.closed_after.clear()
            self.left_with_error.clear()
            self._aborts.clear()
            self._backlog.clear()
            self._turns.clear()
            self.counters["stale"] += self.mailbox.discard_where(
                lambda group: _epoch_of(group) < view.epoch
            )
        held, self._held, self._held_bytes = self._held, [], 0
        for sender, env, payload in held:
            self._dispatch(sender, env, payload)

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
            if rank is None or rank in self.closed_after or self.on_peer_lost is None:
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

    async def send(self, peer: int, env: Envelope, payload: Sequence[Any] = ()) -> Sent:
        """Queue a message to the peer of that rank (see `try_send` and `send_in_turn`)."""
        return self.try_send(peer, env, payload) or await self.send_in_turn(peer, env, payload)

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
        waits in a task of the mesh, counted at once, so later sends queue behind it
        even before that task has started; cancelling the caller does not unsend it.
        """
        self._backlog[peer] = self._backlog.get(peer, 0) + 1
        task = self.spawn(self._send_in_turn(peer, env, payload))
        task.add_done_callback(
            lambda _task: self._backlog.__setitem__(peer, self._backlog[peer] - 1)
        )
        return task

    async def _send_in_turn(self, peer: int, env: Envelope, payload: Sequence[Any]) -> Sent:
        async with self._turns.setdefault(peer, asyncio.Lock()):
            return await self._channels[peer].send(env, payload)

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run a coroutine owned by the mesh (awaited on close); returns its task."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._reap)
        return task

    def _reap(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background send failed: %s", task.exception())

    def broadcast_control(self, env: Envelope, peers: Sequence[int] | None = None) -> None:
        """Send a small control message to every peer (or to `peers`), in the background."""
        if self.crashed:
            return
        targets = [p for p in (peers if peers is not None else self._channels) if p != self.rank]

        async def send_all() -> None:
            for peer in targets:
                await self.send(peer, env)

        if targets:
            self.spawn(send_all())

    def abort(self, call: Call, reason: str, message: str, ranks: Sequence[int] = ()) -> None:
        """Tell every peer that `call` failed here, so they fail it too instead of waiting."""
        body = abort_body(reason, message, self.rank, ranks)
        self.broadcast_control(
            Envelope(
                Kind.ABORT, call.epoch, self.rank, call.cid, fingerprint=call.fingerprint, body=body
            )
        )

    # -- calls ------------------------------------------------------------------------------

    def register(self, call: Call) -> None:
        """Make a new call known; an abort that arrived before it was made applies now."""
        self.calls[(call.epoch, call.cid)] = call
        abort = self._aborts.pop(call.cid, None)
        if abort is not None:
            call.fail(error_from_abort(abort, call.fingerprint, self.rank, late=True))

    def check_start(self, call: Call) -> CollectiveError | None:
        """Failures known before the call runs: a peer that left, an early mismatch."""
        for peer, last in self.closed_after.items():
            if last < call.cid:
                return self._goodbye_error(call, peer, last)
        for (peer, _lane), (env, _) in self.mailbox.first_items((call.epoch, call.cid)):
            error = self._mismatch(call, peer, env)
            if error is not None:
                return error
        return None

    def forget(self, cid: int) -> None:
        """Drop what arrived for a collective id this rank gave up before making a call."""
        self._aborts.pop(cid, None)
        self.counters["late"] += self.mailbox.discard((self.epoch, cid))

    def finish(self, call: Call) -> None:
        """Forget a call: later messages for it are dropped as late."""
        self.calls.pop((call.epoch, call.cid), None)
        self.counters["late"] += self.mailbox.discard((call.epoch, call.cid))

    def _mismatch(self, call: Call, peer: int, env: Envelope) -> CollectiveMismatchError | None:
        theirs = env.fingerprint
        if theirs is None:
            raise ProtocolError(f"rank {peer} sent a collective message without fingerprint")
        if not call.fingerprint.conflicts(theirs):
            return None
        message = mismatch_message(call.cid, self.rank, call.fingerprint, peer, theirs)
        self.abort(call, "mismatch", message, (self.rank, peer))
        return CollectiveMismatchError(
            message,
            ranks=(self.rank, peer),
            rank=self.rank,
            epoch=call.epoch,
            cid=call.cid,
            collective=call.fingerprint.collective,
        )

    def _goodbye_error(self, call: Call, peer: int, last: int) -> CollectiveError:
        error = self.left_with_error.get(peer)
        if error is not None:
            return CollectiveAbortedError(
                f"rank {peer} left the group after an error, before collective #{call.cid} "
                f"{call.fingerprint.describe()}: {error}",
                origin=peer,
                rank=self.rank,
                epoch=call.epoch,
                cid=call.cid,
                collective=call.fingerprint.collective,
            )
        return CollectiveMismatchError(
            goodbye_message(call.cid, call.fingerprint, self.rank, peer, last),
            ranks=(self.rank, peer),
            rank=self.rank,
            epoch=call.epoch,
            cid=call.cid,
            collective=call.fingerprint.collective,
        )

    # -- inbound ----------------------------------------------------------------------------

    def _dispatch(self, sender: bytes, env: Envelope, payload: list[memoryview]) -> None:
        if self.view is None or env.epoch > self.epoch:
            size = sum(p.nbytes for p in payload)
            if len(self._held) >= _MAX_HELD or self._held_bytes + size > _MAX_HELD_BYTES:
                raise ProtocolError("too many messages for a view this rank has not seen")
            self._held.append((sender, env, payload))
            self._held_bytes += size
            self.counters["held"] += 1
            return
        if env.epoch < self.epoch:
            self.counters["stale"] += 1
            return
        rank = self._ranks.get(sender)
        if rank is None or rank == self.rank:
            raise ProtocolError(f"{env.kind.name} from {sender[:32]!r}, not a peer of this view")
        if env.src != rank:
            raise ProtocolError(f"rank {rank} claims to be rank {env.src}")
        handler = self._handlers.get(env.kind)
        if handler is None:
            raise ProtocolError(f"{env.kind.name} is not a peer-to-peer message")
        handler(rank, env, payload)

    def _open_call(self, env: Envelope) -> Call | None:
        """The call a message belongs to; None if it is for a call not made yet."""
        call = self.calls.get((env.epoch, env.cid))
        if call is None and env.cid >= self.next_cid + _MAX_AHEAD:
            raise ProtocolError(f"collective #{env.cid} is implausibly far ahead")
        return call

    def handle_chunk(self, rank: int, env: Envelope, payload: list[memoryview]) -> None:
        call = self._open_call(env)
        if call is None and env.cid < self.next_cid:
            self.counters["late"] += 1  # the call already finished (or failed) here
            return
        if call is not None:
            error = self._mismatch(call, rank, env)
            if error is not None:
                call.fail(error)
                return
        self.mailbox.put((env.epoch, env.cid), (rank, _LANES[env.kind]), (env, payload))

    def handle_abort(self, rank: int, env: Envelope, payload: list[memoryview]) -> None:
        call = self._open_call(env)
        if call is not None:
            call.fail(error_from_abort(env, call.fingerprint, self.rank))
        elif env.cid >= self.next_cid:
            Fields(env.body, "Abort").get_str("message", 8192)  # validate before keeping
            self._aborts[env.cid] = env
        else:
            self.counters["late"] += 1

    def handle_probe(self, rank: int, env: Envelope, payload: list[memoryview]) -> None:
        """Answer where this rank is, and give the call up: the prober is about to abort it.

        Failing here, not only on the prober's abort, means a rank that arrives late cannot
        finish from data its peers had already sent while they report a timeout.
        """
        body = {"started": self.next_cid - 1}
        reply = Envelope(Kind.PROGRESS, self.epoch, self.rank, env.cid, body=body)
        self.broadcast_control(reply, [rank])
        message = (
            f"rank {rank} timed out in collective #{env.cid} and gave it up "
            "(its own error says which ranks it was waiting for)"
        )
        given_up = Envelope(
            Kind.ABORT,
            env.epoch,
            rank,
            env.cid,
            fingerprint=env.fingerprint,
            body=abort_body("timeout", message, rank),
        )
        self.handle_abort(rank, given_up, [])

    def handle_progress(self, rank: int, env: Envelope, payload: list[memoryview]) -> None:
        Fields(env.body, "Progress").get_int("started")
        if (env.epoch, env.cid) not in self._probing:
            self.counters["late"] += 1  # the probe already gave up waiting for it
            return
        self.mailbox.put(("progress", env.epoch, env.cid), rank, (env, payload))

    def handle_goodbye(self, rank: int, env: Envelope, payload: list[memoryview]) -> None:
        fields = Fields(env.body, "Goodbye")
        last = fields.get_int("last")
        error = fields.get_str("error", 2048, optional=True)
        self.peer_closed(rank, last, error)

    def peer_closed(self, rank: int, last: int, error: str | None = None) -> int:
        """Rank `rank` closed after collective `last`: fail this epoch's later calls.

        Returns how many calls in flight failed.
        """
        self.closed_after.setdefault(rank, last)
        if error is not None:
            self.left_with_error.setdefault(rank, error)
        failed = 0
        for call in list(self.calls.values()):
            if call.cid > last and call.failure is None:
                call.fail(self._goodbye_error(call, rank, last))
                failed += 1
        for tag in {r.tag for r in self.receives if r.peer == rank}:
            # A marker behind the messages already queued: they are still delivered.
            self.mailbox.put(("p2p", self.epoch), (rank, tag), (PEER_LEFT, []))
        return failed

    def fail_all(self, make_error: Callable[[Call], BaseException], after: int = 0) -> int:
        """Fail every call in flight numbered above `after`, and every receive; returns
        how many failed."""
        failed = 0
        for call in [*self.calls.values(), *self.receives]:
            wanted = call.cid > after or call in self.receives
            running = call.failure is None and not (call.task is not None and call.task.done())
            if wanted and running:
                call.fail(make_error(call))
                failed += 1
        return failed

    def peer_left_error(self, peer: int, what: str) -> CollectiveAbortedError:
        """The error of a send to, or receive from, a peer that closed its communicator."""
        error = self.left_with_error.get(peer)
        why = f" after an error: {error}" if error is not None else ""
        return CollectiveAbortedError(
            f"{what} rank {peer} cannot complete: rank {peer} closed its communicator{why}",
            origin=peer,
            rank=self.rank,
            epoch=self.epoch,
            collective=what.split()[0],
        )

    def handle_peer_message(self, rank: int, env: Envelope, payload: list[memoryview]) -> None:
        if env.fingerprint is None:
            raise ProtocolError("a point-to-point message needs a fingerprint")
        self.mailbox.put(("p2p", env.epoch), (rank, env.step), (env, payload))

    # -- diagnosis --------------------------------------------------------------------------

    async def probe(self, call: Call) -> dict[int, int | None]:
        """Ask every peer for its last started collective (None: no answer in time)."""
        peers = [p for p in range(self.size) if p != self.rank]
        probe = Envelope(Kind.PROBE, call.epoch, self.rank, call.cid, fingerprint=call.fingerprint)
        self.broadcast_control(probe)
        progress: dict[int, int | None] = dict.fromkeys(peers)
        self._probing.add((call.epoch, call.cid))
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.probe_timeout):
                    for peer in peers:
                        env, _ = await self.mailbox.get(("progress", call.epoch, call.cid), peer)
                        progress[peer] = Fields(env.body, "Progress").get_int("started")
        finally:
            self._probing.discard((call.epoch, call.cid))
            self.mailbox.discard(("progress", call.epoch, call.cid))
        return progress

    # -- shutdown ---------------------------------------------------------------------------

    async def crash(self) -> None:
        """Close every socket at once, sending nothing (tests: a process killed)."""
        self.crashed = True
        self.on_peer_lost = None
        for task in list(self._background):
            task.cancel()
        for channel in self._by_member.values():
            await channel.aclose(linger_s=0.0)
        self._channels.clear()
        self._by_member.clear()
        if self._endpoint is not None:
            await self._endpoint.aclose()
        self.view = None

    async def aclose(self, error: str | None = None) -> None:
        """Say goodbye to the peers (with the error that ends this rank, if any), flush
        background sends, close every socket."""
        if self.view is not None:
            body: dict[str, Any] = {"last": self.next_cid - 1}
            if error is not None:
                body["error"] = error[:2048]
            self.broadcast_control(Envelope(Kind.GOODBYE, self.epoch, self.rank, body=body))
        if self._background:
            await asyncio.wait(self._background, timeout=2.0)
        for task in list(self._background):
            task.cancel()
        self.on_peer_lost = None
        for channel in self._by_member.values():
            await channel.aclose(linger_s=1.0)
        self._channels.clear()
        self._by_member.clear()
        if self._endpoint is not None:
            await self._endpoint.aclose()

    def __repr__(self) -> str:
        return (
            f"<Mesh rank={self.rank}/{self.size} epoch={self.epoch} calls={len(self.calls)} "
            f"mailbox={len(self.mailbox)} dropped={self.dropped} {dict(self.counters)}>"
        )


def _epoch_of(group: Any) -> int:
    """The epoch of a mailbox group key: (epoch, cid), ("p2p", epoch), ("progress", e, c)."""
    if isinstance(group, tuple) and group:
        first = group[0]
        if isinstance(first, int):
            return first
        if len(group) > 1 and isinstance(group[1], int):
            return group[1]
    return 0
