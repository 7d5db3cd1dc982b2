"""Who serves and who works, by member id, and waiting out a change of view (ps layer).

Roles are fixed when the parameter servers open: the last `servers` ranks of the view
serve, the others work, in rank order. They are kept as member ids, which a change of
view does not renumber, so a server stays the same server when a worker before it is
lost and every rank moves down.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..communicator import Communicator
from ..errors import ConfigError, EvictedError, MembershipChangedError
from ..membership import View

__all__ = ["Roles", "wait_next_view"]

_RETRY_S = (0.005, 0.1)  # the first and the longest pause between tries


@dataclass(frozen=True)
class Roles:
    """Member ids of the workers and of the servers, each in index order."""

    workers: tuple[str, ...]
    servers: tuple[str, ...]

    @classmethod
    def of(cls, view: View, servers: int) -> Roles:
        """The last `servers` members serve; at least one member must be left to work."""
        if not 1 <= servers < view.size:
            raise ConfigError(
                f"servers={servers} needs 1 <= servers < world size ({view.size}): "
                "at least one rank must serve and one must work"
            )
        ids = tuple(m.id for m in view.members)
        return cls(workers=ids[:-servers], servers=ids[-servers:])

    def role_of(self, member_id: str) -> tuple[str, int]:
        """("worker" or "server", its index)."""
        if member_id in self.servers:
            return "server", self.servers.index(member_id)
        return "worker", self.workers.index(member_id)


async def wait_next_view(
    comm: Communicator, failed: MembershipChangedError, timeout_s: float
) -> View:
    """After a call failed with `failed`, wait until this rank knows a newer view.

    An evicted rank has no view to wait for: its error is raised again at once.
    """
    if isinstance(failed, EvictedError):
        raise failed
    epoch = failed.epoch if failed.epoch is not None else comm.view.epoch
    pause = _RETRY_S[0]
    async with asyncio.timeout(timeout_s):
        while comm.view.epoch <= epoch:
            await asyncio.sleep(pause)
            pause = min(2 * pause, _RETRY_S[1])
    return comm.view


async def retry_pause(attempt: int) -> None:
    """A short pause before a call is tried again while a view is being installed."""
    await asyncio.sleep(min(_RETRY_S[0] * 2**attempt, _RETRY_S[1]))
