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

The roles live in modules of their own, each a class over the shared state of
`RegistryCore` (registry_core.py: the state, publishing views): `RegistryJoins` (forming,
joins, leaves), `RegistryLiveness` (heartbeats, the watchdog, suspects) and
`RegistryRestarts` (reported and agreed views). This module binds the endpoint and
dispatches each message kind to its handler.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from .._opener import Opener
from ..config import RegistryConfig
from ..errors import ProtocolError
from ..transport import Endpoint
from ..wire import Envelope, Kind
from .live import mark_waited_for
from .registry_joins import RegistryJoins
from .registry_liveness import RegistryLiveness
from .registry_restarts import RegistryRestarts
from .view import View

__all__ = ["Registry", "open_registry"]

log = logging.getLogger("dsml.registry")

_SLOW_S = 1.0  # see `status()`
#: Replies queued per connection before more are dropped (and counted in
#: `undelivered_replies`): a connection that sends requests but does not read costs at
#: most this many replies' bytes. A dropped view is sent again (see handle_heartbeat).
REPLY_QUEUE = 256


class Registry(RegistryJoins, RegistryLiveness, RegistryRestarts):
    """A running registry; see the module docstring. Open with `open_registry`."""

    def __init__(self, config: RegistryConfig) -> None:
        super().__init__(config)
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
            sndhwm=REPLY_QUEUE,
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

    # -- dispatch ---------------------------------------------------------------------------

    def _dispatch(self, sender: bytes, env: Envelope, payload: list[memoryview]) -> None:
        handler = self._handlers.get(env.kind)
        if handler is None:
            raise ProtocolError(f"the registry does not accept {env.kind.name}")
        if payload:
            raise ProtocolError(f"{env.kind.name} carries no payload frames")
        handler(sender, env)

    # -- worker daemons ---------------------------------------------------------------------

    def handle_worker_hello(self, sender: bytes, env: Envelope) -> None:
        record = self.pool.hello(env.body, sender)
        log.debug("worker %s at %s is %s", record.name, record.address, record.state)

    def handle_worker_bye(self, sender: bytes, env: Envelope) -> None:
        self.pool.bye(env.body, sender)

    # -- status -----------------------------------------------------------------------------

    def handle_status_request(self, sender: bytes, env: Envelope) -> None:
        self._reply(sender, Kind.STATUS_REPLY, self.status())

    def status(self) -> dict[str, Any]:
        """What `dsml status` shows: members with their health and progress (each with its
        last progress summary and the ranks waiting for it: membership/live.py), joiners,
        the recent view changes with why."""
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
                    "progress": live.progress if live else None,
                }
            )
        # A call running this long, with peers behind it, counts as waiting for them
        # before any probe names them (heartbeats are up to an interval apart).
        waited_for = mark_waited_for(members, max(_SLOW_S, 2 * self.config.heartbeat_interval))
        return {
            "epoch": self._epoch,
            "formed": view is not None,
            "members": members,
            "joining": [j.member.to_wire() for j in self._joining.values()]
            + [m.to_wire() for m in self._pending.values()],
            "world_size": view.size if view else self._target_size(),
            "evicted": list(self._evicted)[-16:],
            "refused": list(self._refused),
            "workers": self.pool.listing(),
            "heartbeat_interval": self.config.heartbeat_interval,
            "heartbeat_timeout": self.config.heartbeat_timeout,
            "views_published": self.views_published,
            "dropped_messages": self.dropped_messages,
            "undelivered_replies": self.undelivered,
            "stalls": self.stalls,
            "views_adopted": self.adopted,
            "waited_for": waited_for,  # the ranks someone waits for (each has `waited_by`)
            "views": self.view_log.listing(),
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
