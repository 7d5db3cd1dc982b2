"""The member's side of the registry protocol (membership layer).

A `RegistryClient` owns one channel to the registry, identified by the member id. It joins,
waits for the view that contains it, answers status queries, and leaves. It never touches
the data path: collectives do not wait on the registry.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

from ..config import CommConfig
from ..errors import ConfigError, JoinTimeoutError, ProtocolError, RegistryUnavailableError
from ..transport import Channel, Mailbox
from ..wire import Envelope, Fields, Kind
from .view import Member, View

__all__ = ["RegistryClient", "query_status"]

log = logging.getLogger("dsml.membership")

_REPLY_KINDS = (Kind.JOIN_ACCEPTED, Kind.JOIN_REJECTED, Kind.STATUS_REPLY)


class RegistryClient:
    """Joins a group through the registry at `address` on behalf of `member`."""

    def __init__(self, address: str, member: Member, config: CommConfig) -> None:
        self.address = address
        self.member = member
        self.config = config
        self.view: View | None = None
        self._replies: Mailbox[Envelope] = Mailbox()
        self._view_changed = asyncio.Event()
        self._channel: Channel | None = None

    def open(self) -> None:
        """Connect the channel (ZeroMQ connects in the background; nothing waits here)."""
        self._channel = Channel.connect(
            self.address, self.member.id.encode(), handler=self._dispatch, linger_s=1.0
        )

    def _dispatch(self, sender: bytes, env: Envelope, payload: list[memoryview]) -> None:
        if env.kind in _REPLY_KINDS:
            self._replies.put(env.kind, None, env)
        elif env.kind is Kind.VIEW_CHANGED:
            self._handle_view_changed(env)
        else:
            raise ProtocolError(f"unexpected {env.kind.name} from the registry")

    def _handle_view_changed(self, env: Envelope) -> None:
        view = View.from_wire(Fields(env.body, "ViewChanged"))
        if view.rank_of(self.member.id) is None:
            raise ProtocolError("ViewChanged does not list this member")
        if self.view is None or view.epoch > self.view.epoch:
            self.view = view
            self._view_changed.set()

    async def _request(self, kind: Kind, body: dict[str, Any]) -> None:
        assert self._channel is not None, "RegistryClient.open() first"
        await self._channel.send(Envelope(kind, body=body))

    async def _reply(self, *kinds: Kind) -> Envelope:
        waits = {asyncio.ensure_future(self._replies.get(k, None)): k for k in kinds}
        try:
            async with asyncio.timeout(self.config.registry_timeout):
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except TimeoutError:
            raise RegistryUnavailableError(
                f"no registry answered at {self.address} within "
                f"{self.config.registry_timeout:g} s: is it running? Start one with "
                f"`dsml registry --address {self.address}`, or check DSML_REGISTRY",
                address=self.address,
            ) from None
        finally:
            for wait in waits:
                wait.cancel()
        return next(iter(done)).result()

    async def join(self, world_size: int, rank: int | None = None) -> View:
        """Join and wait until the group has formed; returns the first view."""
        await self._request(
            Kind.JOIN_REQUEST,
            {"member": self.member.to_wire(), "world_size": world_size, "rank": rank},
        )
        reply = await self._reply(Kind.JOIN_ACCEPTED, Kind.JOIN_REJECTED)
        if reply.kind is Kind.JOIN_REJECTED and self.view is None:
            reason = Fields(reply.body, "JoinRejected").get_str("reason", 4096)
            raise ConfigError(
                f"the registry at {self.address} refused to add this worker: {reason}"
            )
        try:
            async with asyncio.timeout(self.config.join_timeout):
                await self._view_changed.wait()
        except TimeoutError:
            raise JoinTimeoutError(await self._formation_report(world_size)) from None
        assert self.view is not None
        return self.view

    async def _formation_report(self, world_size: int) -> str:
        try:
            status = await self.status()
            joined = len(status.get("joining", []))
        except RegistryUnavailableError:
            joined = -1
        await self.leave()
        have = f"{joined} of {world_size}" if joined >= 0 else f"fewer than {world_size}"
        return (
            f"the group did not form within {self.config.join_timeout:g} s: {have} members "
            f"joined the registry at {self.address}. Start the missing workers (dsml run -n "
            f"{world_size} starts them all), or lower world_size"
        )

    async def status(self) -> dict[str, Any]:
        """The registry's description of the group."""
        await self._request(Kind.STATUS_REQUEST, {})
        reply = await self._reply(Kind.STATUS_REPLY)
        return reply.body or {}

    async def leave(self) -> None:
        """Tell the registry this member is going (best effort, no reply)."""
        if self._channel is not None and not self._channel.closed:
            await self._request(Kind.LEAVE_REQUEST, {})

    async def aclose(self) -> None:
        if self._channel is not None:
            await self._channel.aclose()

    def __repr__(self) -> str:
        return f"<RegistryClient {self.member.id} -> {self.address} view={self.view!r}>"


async def query_status(address: str, *, registry_timeout: float = 5.0) -> dict[str, Any]:
    """Ask the registry at address for its status (used by `dsml status`)."""
    member = Member(id=f"status-{secrets.token_hex(6)}", address="")
    client = RegistryClient(address, member, CommConfig(registry_timeout=registry_timeout))
    client.open()
    try:
        return await client.status()
    finally:
        await client.aclose()
