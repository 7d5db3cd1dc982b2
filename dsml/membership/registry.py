"""The registry server: joins, rank assignment, views (membership layer).

The registry is not on the data path: it only tells members who their peers are. It binds
one endpoint; members connect a channel whose identity is their member id. Ranks are given
in join order, except that members asking for a rank (as `dsml run` does) get it. When
`world_size` members have joined, the registry forms the group at a new epoch and sends the
view to every member. When every member of a group has left, the registry is ready to form
the next group. Malformed messages are dropped and counted; the registry keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._opener import Opener
from ..config import RegistryConfig
from ..errors import ConfigError, ProtocolError
from ..transport import Endpoint, check_address
from ..wire import Envelope, Fields, Kind
from .view import Member, View

__all__ = ["Registry", "open_registry"]

log = logging.getLogger("dsml.registry")

_MAX_WORLD = 1 << 16


@dataclass(frozen=True, slots=True)
class _Joiner:
    member: Member
    world_size: int
    wanted_rank: int | None


class Registry:
    """A running registry; see the module docstring. Open with `open_registry`."""

    def __init__(self, config: RegistryConfig) -> None:
        self.config = config
        self._endpoint: Endpoint | None = None
        self._closed = asyncio.Event()
        self.undelivered = 0  # replies dropped: the peer was gone or did not read
        self._joining: dict[str, _Joiner] = {}
        self._view: View | None = None
        self._left: set[str] = set()
        self._epoch = 0
        self._handlers: dict[Kind, Callable[[bytes, Envelope], None]] = {
            Kind.JOIN_REQUEST: self.handle_join_request,
            Kind.LEAVE_REQUEST: self.handle_leave_request,
            Kind.STATUS_REQUEST: self.handle_status_request,
        }

    async def _start(self) -> Registry:
        self._endpoint = Endpoint.bind(
            self.config.address,
            self._dispatch,
            max_frame_bytes=self.config.max_message_bytes,
            max_envelope_bytes=self.config.max_message_bytes,
            name="registry",
        )
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
    def dropped_messages(self) -> int:
        """Malformed or unexpected messages dropped so far."""
        return self._endpoint.dropped if self._endpoint is not None else 0

    async def wait_closed(self) -> None:
        await self._closed.wait()

    async def aclose(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._endpoint is not None:
            await self._endpoint.aclose()

    # -- dispatch ---------------------------------------------------------------------------

    def _dispatch(self, sender: bytes, env: Envelope, payload: list[memoryview]) -> None:
        handler = self._handlers.get(env.kind)
        if handler is None:
            raise ProtocolError(f"the registry does not accept {env.kind.name}")
        if payload:
            raise ProtocolError(f"{env.kind.name} carries no payload frames")
        handler(sender, env)

    def _reply(self, identity: bytes, kind: Kind, body: dict[str, Any]) -> None:
        assert self._endpoint is not None
        if not self._endpoint.send_nowait(identity, Envelope(kind, self._epoch, body=body)):
            self.undelivered += 1
            log.info("could not deliver %s to %r (gone, or not reading)", kind.name, identity[:32])

    # -- handlers ---------------------------------------------------------------------------

    def handle_join_request(self, sender: bytes, env: Envelope) -> None:
        fields = Fields(env.body, "JoinRequest")
        member = Member.from_wire(fields.get_map("member"))
        world_size = fields.get_int("world_size", 1, _MAX_WORLD)
        wanted = fields.get_int("rank", 0, _MAX_WORLD, optional=True)
        if sender != member.id.encode():
            raise ProtocolError("JoinRequest identity does not match its member id")
        if self._view is not None and self._view.rank_of(member.id) is not None:
            self._reply(sender, Kind.VIEW_CHANGED, self._view.to_wire())  # a retry
            return
        reason = self._join_refusal(member, world_size, wanted)
        if reason:
            log.warning("refused %s: %s", member.describe(), reason)
            self._reply(sender, Kind.JOIN_REJECTED, {"reason": reason})
            return
        self._joining[member.id] = _Joiner(member, world_size, wanted)
        self._reply(
            sender, Kind.JOIN_ACCEPTED, {"joined": len(self._joining), "world_size": world_size}
        )
        if len(self._joining) == world_size:
            self._form_group(world_size)

    def _join_refusal(self, member: Member, world_size: int, wanted: int | None) -> str:
        try:
            check_address(member.address, "member address")
        except ConfigError as exc:
            return str(exc)
        if self._view is not None:
            return (
                f"a group of {self._view.size} is running at epoch {self._view.epoch}; "
                "wait until it ends or use another registry"
            )
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
        self._epoch += 1
        self._view = View(self._epoch, members)
        self._joining.clear()
        self._left.clear()
        log.info("formed a group of %d at epoch %d", world_size, self._epoch)
        for member in members:
            self._reply(member.id.encode(), Kind.VIEW_CHANGED, self._view.to_wire())

    def handle_leave_request(self, sender: bytes, env: Envelope) -> None:
        member_id = sender.decode(errors="replace")
        if self._joining.pop(member_id, None) is not None:
            return
        if self._view is None or self._view.rank_of(member_id) is None:
            return
        self._left.add(member_id)
        if len(self._left) == self._view.size:
            log.info("every member of epoch %d left; ready for a new group", self._epoch)
            self._view = None
            self._left.clear()

    def handle_status_request(self, sender: bytes, env: Envelope) -> None:
        self._reply(sender, Kind.STATUS_REPLY, self.status())

    def status(self) -> dict[str, Any]:
        """What `dsml status` shows: the group, who is still joining, dropped messages."""
        view = self._view
        return {
            "epoch": self._epoch,
            "formed": view is not None,
            "members": [m.to_wire() for m in view.members] if view else [],
            "left": sorted(self._left),
            "joining": [j.member.to_wire() for j in self._joining.values()],
            "world_size": view.size if view else self._target_size(),
            "dropped_messages": self.dropped_messages,
            "undelivered_replies": self.undelivered,
        }

    def _target_size(self) -> int:
        return next(iter(self._joining.values())).world_size if self._joining else 0

    def __repr__(self) -> str:
        state = f"epoch={self._epoch} size={self._view.size}" if self._view else "forming"
        address = self._endpoint.address if self._endpoint else "unbound"
        return (
            f"<Registry {address} {state} joining={len(self._joining)} "
            f"dropped={self.dropped_messages}>"
        )


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
