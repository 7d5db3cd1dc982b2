"""Helpers for testing code that uses dsml (shipped; nothing in dsml imports this package).

`open_local_cluster(n)` starts a registry and n communicators in the current event loop,
talking over real ZeroMQ sockets on loopback, so a whole group fits in one test:

    async with dsml.testing.open_local_cluster(4) as cluster:
        results = await cluster.run(lambda comm: comm.all_reduce(np.ones(3) * comm.rank))

`MemoryNetwork(n)` gives n in-memory `Group`s (no sockets) to test algorithms with.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from .._opener import Opener
from ..communicator import Communicator, init
from ..config import CommConfig, RegistryConfig
from ..membership import Registry, open_registry
from .faults import Faults, crash, inject
from .memory_group import MemoryGroup, MemoryNetwork

__all__ = [
    "Faults",
    "InProcessCluster",
    "MemoryGroup",
    "MemoryNetwork",
    "crash",
    "inject",
    "open_local_cluster",
]

T = TypeVar("T")


class InProcessCluster:
    """A registry and its communicators, all in this event loop (rank order)."""

    def __init__(self, registry: Registry, comms: list[Communicator]) -> None:
        self.registry = registry
        self.comms = comms

    def __len__(self) -> int:
        return len(self.comms)

    def __getitem__(self, rank: int) -> Communicator:
        return self.comms[rank]

    def __iter__(self) -> Iterator[Communicator]:
        return iter(self.comms)

    async def run(self, fn: Callable[[Communicator], Awaitable[T]]) -> list[T]:
        """Call fn(comm) on every rank concurrently; results in rank order.

        Every rank's outcome is awaited before the first exception (if any) is raised,
        and fn is called on every rank even where it raises at once (a collective that
        refuses its arguments raises `ConfigError` when called, not when awaited): skipping
        the ranks after it would leave them a collective behind the others.
        """

        async def on(comm: Communicator) -> T:
            return await fn(comm)

        outcomes = await asyncio.gather(*(on(c) for c in self.comms), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return list(outcomes)  # type: ignore[arg-type]

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.comms), return_exceptions=True)
        await self.registry.aclose()

    def __repr__(self) -> str:
        return f"<InProcessCluster size={len(self.comms)} registry={self.registry.address}>"


def open_local_cluster(
    n: int, *, config: CommConfig | None = None, registry_config: RegistryConfig | None = None
) -> Opener[InProcessCluster]:
    """Start a registry and n communicators (ranks 0..n-1) in this event loop."""

    async def start() -> InProcessCluster:
        registry = await open_registry(config=registry_config)
        joins = [init(registry.address, world_size=n, rank=r, config=config) for r in range(n)]
        outcomes = await asyncio.gather(*joins, return_exceptions=True)
        comms = [c for c in outcomes if isinstance(c, Communicator)]
        if len(comms) < n:
            await InProcessCluster(registry, comms).aclose()
            raise next(o for o in outcomes if isinstance(o, BaseException))
        return InProcessCluster(registry, comms)

    return Opener(start)
