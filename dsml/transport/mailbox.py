"""Per-key queues filled by a socket's single reader (transport layer).

The reader of a socket never waits on consumers: it puts each message under a key, and
whoever needs that message awaits `get(key)`. Timeouts and cancellation therefore act on
queue waits, never on a half-read socket. Keys live in groups (for collectives, one group
per collective id), so everything left of a finished collective goes in one step.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable
from typing import Any, Generic, TypeVar

__all__ = ["Mailbox"]

T = TypeVar("T")


class Mailbox(Generic[T]):
    """Unbounded FIFO queues, addressed by (group, key), created on first use."""

    def __init__(self) -> None:
        self._groups: dict[Hashable, dict[Hashable, deque[T]]] = {}
        self._waiters: dict[tuple[Hashable, Hashable], asyncio.Future[T]] = {}

    def put(self, group: Hashable, key: Hashable, item: T) -> None:
        """Deliver an item; wakes the waiter of that key if there is one."""
        waiter = self._waiters.pop((group, key), None)
        if waiter is not None and not waiter.done():
            waiter.set_result(item)
            return
        queues = self._groups.get(group)
        if queues is None:
            queues = self._groups[group] = {}
        queue = queues.get(key)
        if queue is None:
            queue = queues[key] = deque()
        queue.append(item)

    async def get(self, group: Hashable, key: Hashable) -> T:
        """Take the oldest item under (group, key), waiting for one (one waiter per key)."""
        queues = self._groups.get(group)
        if queues:
            queue = queues.get(key)
            if queue:
                item = queue.popleft()
                if not queue:
                    del queues[key]
                    if not queues:
                        del self._groups[group]
                return item
        address = (group, key)
        assert address not in self._waiters, f"two waiters on mailbox key {address!r}"
        waiter: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._waiters[address] = waiter
        try:
            return await waiter
        finally:
            if self._waiters.get(address) is waiter:
                del self._waiters[address]

    def first_items(self, group: Hashable) -> list[tuple[Any, T]]:
        """(key, oldest item) of every non-empty queue of a group, without taking them."""
        return [(key, queue[0]) for key, queue in self._groups.get(group, {}).items() if queue]

    def discard(self, group: Hashable, key: Hashable | None = None) -> int:
        """Drop the items of one queue, or of a whole group; returns how many."""
        if key is None:
            return sum(len(q) for q in self._groups.pop(group, {}).values())
        queues = self._groups.get(group, {})
        dropped = len(queues.pop(key, ()))
        if not queues:
            self._groups.pop(group, None)
        return dropped

    def groups(self) -> list[Hashable]:
        return list(self._groups)

    def __len__(self) -> int:
        return sum(len(q) for queues in self._groups.values() for q in queues.values())

    def __repr__(self) -> str:
        return (
            f"<Mailbox groups={len(self._groups)} items={len(self)} waiters={len(self._waiters)}>"
        )
