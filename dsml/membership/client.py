"""The member's side of the registry protocol (membership layer).

A `RegistryClient` owns one channel to the registry, identified by the member id, and a
heartbeat thread (`Beacon`). It joins, waits for the view that contains it, then passes
every later message of the registry (new views, proposals, evictions, a restarted
registry's questions) to the `Listener` the communicator gives it. It never touches the
data path: collectives do not wait on the registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..config import CommConfig
from ..errors import ConfigError, JoinTimeoutError, ProtocolError, RegistryUnavailableError
from ..transport import Beacon, Channel, Mailbox
from ..transport.addresses import split_tcp
from ..wire import Envelope, Fields, Kind
from .view import Change, Member, View

__all__ = ["Listener", "RegistryClient", "query_status"]

log = logging.getLogger("dsml.membership")

_REPLY_KINDS = (Kind.JOIN_ACCEPTED, Kind.JOIN_REJECTED, Kind.STATUS_REPLY)
_JOIN_RESEND_S = 2.0  # a join request lost to a registry restart is sent again
#: the most a leave waits to be queued (see `RegistryClient.leave`)
LEAVE_SEND_S = 1.0


class Listener(Protocol):
    """What a member does with the registry's news (the communicator implements it)."""

    def on_view(self, view: View, change: Change) -> None: ...
    def on_propose(self, epoch: int) -> None: ...
    def on_evicted(self, epoch: int, reason: str) -> None: ...
    def on_reregister(self) -> None: ...


class RegistryClient:
    """Joins a group through the registry at `address` on behalf of `member`."""

    def __init__(self, address: str, member: Member, config: CommConfig) -> None:
        self.address = address
        self.member = member
        self.config = config
        self.view: View | None = None
        self.listener: Listener | None = None
        self.heartbeat_interval = 1.0
        self.heartbeat_timeout = 10.0
        self.last_heard = time.monotonic()  # when the registry last said anything to us
        #: ranks of the running group in this process, when this join waits for it to end
        self._own_ranks: list[int] = []
        self._replies: Mailbox[Envelope] = Mailbox()
        self._view_changed = asyncio.Event()
        self._channel: Channel | None = None
        self._beacon: Beacon | None = None
        self._early: list[tuple[View, Change]] = []
        self._refused = asyncio.Event()  # the registry refused our secret (or key)
        self._refusal = ""

    def open(self) -> None:
        """Connect the channel (ZeroMQ connects in the background; nothing waits here)."""
        self._channel = Channel.connect(
            self.address,
            self.member.id.encode(),
            handler=self._dispatch,
            linger_s=1.0,
            curve=self.config.curve,
            on_refused=self._on_refused,
        )

    def _on_refused(self, reason: str) -> None:
        self._refusal = reason
        self._refused.set()

    def _dispatch(self, sender: bytes, env: Envelope, payload: list[memoryview]) -> None:
        self.last_heard = time.monotonic()
        if env.kind is Kind.HEARTBEAT_ACK:
            return  # only its arrival matters: the registry hears this member
        if env.kind in _REPLY_KINDS:
            self._replies.put(env.kind, None, env)
        elif env.kind is Kind.VIEW_CHANGED:
            self._handle_view_changed(env)
        elif env.kind is Kind.PING:
            pass  # the registry checked that this member is connected
        elif self.listener is None:
            if env.kind not in (Kind.PROPOSE, Kind.EVICTED, Kind.REREGISTER):
                raise ProtocolError(f"unexpected {env.kind.name} from the registry")
        elif env.kind is Kind.PROPOSE:
            self.listener.on_propose(Fields(env.body, "Propose").get_int("epoch", 1))
        elif env.kind is Kind.EVICTED:
            fields = Fields(env.body, "Evicted")
            self.listener.on_evicted(fields.get_int("epoch"), fields.get_str("reason", 1024))
        elif env.kind is Kind.REREGISTER:
            fields = Fields(env.body, "Reregister")
            interval = fields.get_float("heartbeat_interval", 1e-3, 3600)
            self.heartbeat_interval = interval
            if fields.has("heartbeat_timeout"):
                self.heartbeat_timeout = fields.get_float("heartbeat_timeout", 2e-3, 36000)
            if self._beacon is not None:
                self._beacon.interval = interval  # this registry's settings from now on
            if self.view is not None:
                self._send_nowait(Kind.REJOIN, {"view": self.view.to_wire()})
            self.listener.on_reregister()
        else:
            raise ProtocolError(f"unexpected {env.kind.name} from the registry")

    def _handle_view_changed(self, env: Envelope) -> None:
        fields = Fields(env.body, "ViewChanged")
        view = View.from_wire(fields)
        change = Change.from_wire(fields)
        if view.rank_of(self.member.id) is None:
            raise ProtocolError("ViewChanged does not list this member")
        if self.view is not None and view.epoch <= self.view.epoch:
            return
        self.heartbeat_interval = change.heartbeat_interval
        self.heartbeat_timeout = change.heartbeat_timeout
        if self.listener is None and self.view is not None:
            self._early.append((view, change))  # for the listener, once there is one
            return
        self.view = view
        self._view_changed.set()
        if self.listener is not None:
            self.listener.on_view(view, change)

    def attach(self, listener: Listener) -> None:
        """Pass every later message to `listener`, starting with the views that arrived
        after the first (the one `join` returned)."""
        self.listener = listener
        early, self._early = self._early, []
        for view, change in early:
            self.view = view
            listener.on_view(view, change)

    def _send_nowait(self, kind: Kind, body: dict[str, Any]) -> None:
        if self._channel is not None and not self._channel.closed:
            self._channel.send_nowait(Envelope(kind, body=body))

    # -- liveness ---------------------------------------------------------------------------

    def start_heartbeats(self, progress: Callable[[], dict[str, Any]]) -> None:
        """Beat every interval the registry asked for; `progress()` fills each beat."""
        if self._beacon is None:
            self._beacon = Beacon(
                self.address,
                self.member.id.encode() + b".hb",
                self.heartbeat_interval,
                lambda: Envelope(Kind.HEARTBEAT, body=progress()),
                curve=self.config.curve,
            )

    def stop_heartbeats(self) -> None:
        if self._beacon is not None:
            self._beacon.stop()
            self._beacon = None

    def registry_silent_for(self) -> float:
        """Seconds since the registry last said anything to this member (it acknowledges
        every heartbeat, so more than the heartbeat timeout means it is away)."""
        return time.monotonic() - self.last_heard

    @property
    def beacon(self) -> Beacon | None:
        return self._beacon

    def suspect(self, member_id: str, epoch: int) -> None:
        """Report that the connection to `member_id` dropped (the registry checks it)."""
        self._send_nowait(Kind.SUSPECT, {"member": member_id, "epoch": epoch})

    def agreed(self, view: View, previous: int, lost: list[str]) -> None:
        """Tell the registry the survivors of epoch `previous` agreed on `view` without it
        (it adopts the view when it hears this, or asks again after a heartbeat)."""
        if self.view is None or view.epoch > self.view.epoch:
            self.view = view  # what this member reports from now on (REJOIN)
        body = {"view": view.to_wire(), "previous": previous, "lost": lost}
        self._send_nowait(Kind.VIEW_AGREED, body)

    def ready(self, epoch: int, next_cid: int) -> None:
        """Answer a proposal: collectives from `next_cid` on wait for the registry."""
        self._send_nowait(Kind.READY, {"epoch": epoch, "next_cid": next_cid})

    async def _request(self, kind: Kind, body: dict[str, Any]) -> None:
        assert self._channel is not None, "RegistryClient.open() first"
        await self._channel.send(Envelope(kind, body=body))

    async def _reply(self, *kinds: Kind) -> Envelope:
        waits = {asyncio.ensure_future(self._replies.get(k, None)): k for k in kinds}
        refused = asyncio.ensure_future(self._refused.wait())
        try:
            async with asyncio.timeout(self.config.registry_timeout):
                done, _ = await asyncio.wait([*waits, refused], return_when=asyncio.FIRST_COMPLETED)
            replies = [w for w in done if w is not refused]
            if not replies:
                raise RegistryUnavailableError(
                    f"the registry at {self.address} refused this process's connection: "
                    f"{self._refusal}",
                    address=self.address,
                )
        except TimeoutError:
            keys = (
                "is this client's public key in its DIR/authorized list?"
                if self.config.curve is not None
                else "a registry started with --curve-keys answers only clients with keys "
                "(--curve-keys DIR or DSML_CURVE_KEYS)"
            )
            raise RegistryUnavailableError(
                f"no registry answered at {self.address} within "
                f"{self.config.registry_timeout:g} s: {_who_listens(self.address)}; {keys}",
                address=self.address,
            ) from None
        finally:
            refused.cancel()
            for wait in waits:
                wait.cancel()
        reply = replies[0].result()
        assert isinstance(reply, Envelope)
        return reply

    async def join(
        self, world_size: int, rank: int | None = None, *, running: bool = False
    ) -> View:
        """Join and wait until the group has formed; returns the first view. `running`:
        a group running at the registry admits this member whatever its world_size (else
        only while it has fewer members; the member waits for the next group otherwise)."""
        request = {
            "member": self.member.to_wire(),
            "world_size": world_size,
            "rank": rank,
            "running": running,
        }
        await self._request(Kind.JOIN_REQUEST, request)
        reply = await self._reply(Kind.JOIN_ACCEPTED, Kind.JOIN_REJECTED)
        if reply.kind is Kind.JOIN_REJECTED and self.view is None:
            reason = Fields(reply.body, "JoinRejected").get_str("reason", 4096)
            raise ConfigError(
                f"the registry at {self.address} refused to add this worker: {reason}"
            )
        if reply.kind is Kind.JOIN_ACCEPTED:
            fields = Fields(reply.body, "JoinAccepted")
            self.heartbeat_interval = fields.get_float("heartbeat_interval", 1e-3, 3600.0)
            if fields.has("heartbeat_timeout"):
                self.heartbeat_timeout = fields.get_float("heartbeat_timeout", 2e-3, 36000.0)
            if fields.has("waits_for"):
                self._warn_waiting(fields.get_map("waits_for"))
        asked, unanswered = time.monotonic(), 0
        try:
            async with asyncio.timeout(self.config.join_timeout):
                while not self._view_changed.is_set():
                    try:
                        async with asyncio.timeout(_JOIN_RESEND_S):
                            await self._view_changed.wait()
                    except TimeoutError:  # the registry may have restarted: ask again
                        unanswered = unanswered + 1 if self.last_heard < asked else 0
                        self._check_registry_answers(unanswered)
                        self._replies.discard(Kind.JOIN_ACCEPTED)  # to earlier requests
                        asked = time.monotonic()
                        await self._request(Kind.JOIN_REQUEST, request)
        except TimeoutError:
            raise JoinTimeoutError(await self._formation_report(world_size)) from None
        assert self.view is not None
        return self.view

    def _warn_waiting(self, running: Fields) -> None:
        """A group runs at the registry and this join waits for it to end: say so now,
        not only when join_timeout runs out."""
        size, epoch = running.get_int("size", 1), running.get_int("epoch", 0)
        mine = running.int_list("mine", 0, 1 << 16)
        message = (
            f"a group of {size} (epoch {epoch}) is running at the registry at "
            f"{self.address}, which forms one group at a time: this worker waits for it "
            f"to end (at most join_timeout, {self.config.join_timeout:g} s)"
        )
        if mine:
            ranks = ", ".join(map(str, mine))
            message += (
                f". Rank(s) {ranks} of that group run in this very process: close that "
                "communicator first (await comm.aclose()), as when re-running a notebook "
                "cell that calls dsml.init"
            )
            self._own_ranks = mine
        log.warning("%s", message)

    def _check_registry_answers(self, unanswered: int) -> None:
        """While the group forms, every join request sent again gets an answer. Requests
        left unanswered, one after another, for registry_timeout (two at least) mean the
        registry is gone (not restarting quickly). Counted in requests, not in time since
        the registry was last heard: a worker whose own loop stalled has not asked."""
        waited = unanswered * _JOIN_RESEND_S
        if unanswered >= 2 and waited >= self.config.registry_timeout:
            raise RegistryUnavailableError(
                f"the registry at {self.address} stopped answering while the group was "
                f"forming: {unanswered} join requests in {waited:g} s went unanswered "
                f"(registry_timeout {self.config.registry_timeout:g} s). Start it again, "
                "then this worker",
                address=self.address,
            )

    async def _formation_report(self, world_size: int) -> str:
        refused: list[str] = []
        running = 0
        try:
            status = await self.status()
            joined = len(status.get("joining", []))
            refused = [str(r) for r in status.get("refused", [])]
            running = len(status.get("members", [])) if status.get("formed") else 0
        except RegistryUnavailableError:
            joined = -1
        await self.leave()
        have = f"{joined} of {world_size}" if joined >= 0 else f"fewer than {world_size}"
        report = (
            f"the group did not form within {self.config.join_timeout:g} s: {have} members "
            f"joined the registry at {self.address}. Start the missing workers (dsml run -n "
            f"{world_size} starts them all), or lower world_size"
        )
        if running:
            report = (
                f"the group did not form within {self.config.join_timeout:g} s: a group of "
                f"{running} is running at the registry at {self.address}, which forms one "
                f"group at a time, and this worker ({have} joined) waited for it to end. Use "
                "another registry for another job, or leave world_size out to join that group"
            )
            if self._own_ranks:
                report += (
                    f"; rank(s) {', '.join(map(str, self._own_ranks))} of it run in this "
                    "very process: close that communicator first (await comm.aclose())"
                )
        if refused:
            report += (
                f". The registry refused {len(refused)} worker(s) meanwhile; the last: "
                f"{refused[-1]}"
            )
        return report

    async def status(self) -> dict[str, Any]:
        """The registry's description of the group."""
        await self._request(Kind.STATUS_REQUEST, {})
        reply = await self._reply(Kind.STATUS_REPLY)
        return reply.body or {}

    async def leave(self, last: int = 0, epoch: int = 0) -> None:
        """Tell the registry this member is going after collective `last` (no reply), as
        numbered in `epoch`, the last view it entered (0: none).

        Best effort, within LEAVE_SEND_S: where the connection never completed its
        handshake (a wrong port, a CURVE registry and no keys) ZeroMQ has nowhere to queue
        the message and the send would wait forever; a registry that does not hear it
        drops the member when its heartbeats stop."""
        self.stop_heartbeats()
        if self._channel is not None and not self._channel.closed:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(LEAVE_SEND_S):
                    await self._request(Kind.LEAVE_REQUEST, {"last": last, "epoch": epoch})

    async def aclose(self, *, linger_s: float | None = None) -> None:
        self.stop_heartbeats()
        if self._channel is not None:
            await self._channel.aclose(linger_s=linger_s)

    def __repr__(self) -> str:
        return f"<RegistryClient {self.member.id} -> {self.address} view={self.view!r}>"


async def query_status(
    address: str, *, registry_timeout: float = 5.0, curve: Any = None
) -> dict[str, Any]:
    """Ask the registry at address for its status (`dsml status`, `dsml.Client`)."""
    member = Member(id=f"status-{secrets.token_hex(6)}", address="")
    config = CommConfig(registry_timeout=registry_timeout, curve=curve)
    client = RegistryClient(address, member, config)
    client.open()
    try:
        return await client.status()
    finally:
        await client.aclose()


def _who_listens(address: str) -> str:
    """The hint for a registry that did not answer: is anything listening there at all?

    A program that is not a dsml registry on that port (or a registry too busy to answer)
    accepts the TCP connection but never speaks ZeroMQ's handshake, so the client only
    waits; telling the user to start a registry there would fail with "address in use".
    """
    start = f"Start one with `dsml registry --address {address}`, or check DSML_REGISTRY"
    try:
        host, port = split_tcp(address)
        with socket.create_connection((host, int(port)), timeout=1.0):
            pass
    except ConfigError:  # ipc://, or no port to probe
        return f"is it running? {start}"
    except (OSError, ValueError):
        return f"nothing listens there. {start}"
    return (
        "something listens on that port but did not answer as a dsml registry: another "
        "program on the port, or a registry too busy to answer (check the address, or "
        "pick another port)"
    )
