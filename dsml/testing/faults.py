"""Fault injection for tests: wrap a communicator's peer channels (shipped helper).

`inject(comm, Faults(...))` makes that rank's outgoing peer messages go through a plan:
drop some, delay some, cut it off from some members (a partition), or crash the whole
rank after k messages (as if its process were killed: no goodbye, sockets closed).
Only the data plane is wrapped: heartbeats and the registry channel are untouched, so a
partitioned rank is alive to the registry and its peers see timeouts, not losses.

The same-host shared-memory path is part of the data plane, so a cut reaches it too: a
rank cut off from a member (`partition`, or `drop=1.0`: cut off from everyone) never sees
that member's progress in shared memory, and waits as it would for dropped messages,
until the call times out or the view changes. That is what a real partition looks like
from either side. Random drops (`drop < 1`) and delays act on TCP messages only: shared
memory neither loses nor reorders writes, so there is nothing faithful to inject there.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..transport import DONE, Channel, Sent
from ..wire import Envelope

if TYPE_CHECKING:
    from ..communicator import Communicator

__all__ = ["Faults", "crash", "inject"]


@dataclass
class Faults:
    """What to do to one rank's outgoing peer messages.

    Attributes:
        seed: seeds the random choices (print it in a failing test).
        drop: probability of dropping each message.
        delay: probability of delaying a message by up to `max_delay_s` (order between
            two delayed messages may change, as on a congested network it may not: this
            is harsher than TCP).
        crash_after: crash the rank once it has sent this many messages.
        partition: member ids this rank's messages never reach.
    """

    seed: int = 0
    drop: float = 0.0
    delay: float = 0.0
    max_delay_s: float = 0.05
    crash_after: int | None = None
    partition: set[str] = field(default_factory=set)
    sent: int = 0
    dropped: int = 0
    delayed: int = 0
    crashed: bool = False

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._comm: Communicator | None = None

    def decide(self, member_id: str) -> str:
        """'send', 'drop', 'delay' or 'crash' for the next message to member_id."""
        if self.crashed:
            return "drop"
        self.sent += 1
        if self.crash_after is not None and self.sent > self.crash_after:
            return "crash"
        if member_id in self.partition or self._rng.random() < self.drop:
            self.dropped += 1
            return "drop"
        if self._rng.random() < self.delay:
            self.delayed += 1
            return "delay"
        return "send"

    def cuts(self, member_id: str) -> bool:
        """Whether this rank's data link to member_id is cut (no message gets through)."""
        return self.crashed or self.drop >= 1.0 or member_id in self.partition

    def delay_s(self) -> float:
        return self._rng.uniform(0.0, self.max_delay_s)

    def crash_now(self) -> None:
        if not self.crashed and self._comm is not None:
            self.crashed = True
            asyncio.get_running_loop().create_task(self._comm._crash())


class FaultyChannel:
    """A peer channel whose sends pass through a `Faults` plan first."""

    def __init__(self, member_id: str, inner: Channel, faults: Faults) -> None:
        self.member_id = member_id
        self.inner = inner
        self.faults = faults
        self.address = inner.address

    def send_nowait(self, env: Envelope, payload: Sequence[Any] = ()) -> Sent | None:
        action = self.faults.decide(self.member_id)
        if action == "send":
            return self.inner.send_nowait(env, payload)
        if action == "crash":
            self.faults.crash_now()
        elif action == "delay":
            copies = [bytes(memoryview(p)) for p in payload]  # the caller may reuse its buffers
            loop = asyncio.get_running_loop()
            loop.call_later(self.faults.delay_s(), self._late, env, copies)
        return DONE

    def _late(self, env: Envelope, payload: list[bytes]) -> None:
        if not self.inner.closed and not self.faults.crashed:
            self.inner.send_nowait(env, payload)

    async def send(self, env: Envelope, payload: Sequence[Any] = ()) -> Sent:
        receipt = self.send_nowait(env, payload)
        return receipt if receipt is not None else await self.inner.send(env, payload)

    async def aclose(self, *, linger_s: float | None = None) -> None:
        await self.inner.aclose(linger_s=linger_s)

    @property
    def closed(self) -> bool:
        return self.inner.closed


def inject(comm: Communicator, faults: Faults) -> Faults:
    """Send `comm`'s peer messages through `faults` from now on; returns it."""
    faults._comm = comm
    links = comm._session.links

    def wrap(member_id: str, channel: Channel) -> Channel:
        inner = channel.inner if isinstance(channel, FaultyChannel) else channel
        return FaultyChannel(member_id, inner, faults)  # type: ignore[return-value]

    links.inject(wrap, faults.cuts)
    return faults


async def crash(comm: Communicator) -> None:
    """Stop `comm` as if its process had been killed with SIGKILL: it sends no goodbye
    and does not leave; its sockets close at once, so peers see the connections drop."""
    await comm._crash()
