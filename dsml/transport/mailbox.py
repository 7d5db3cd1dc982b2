"""Per-key queues filled by a socket's single reader (transport layer).

The reader task of a socket never waits on consumers: it puts each message under a key
(for collectives `(epoch, cid, src)`), and whoever needs that message awaits `get(key)`.
Timeouts and cancellation therefore act on queue waits, never on a half-read socket.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["Mailbox"]

T = TypeVar("T")


class Mailbox(Generic[T]):
    """Unbounded FIFO queues created on first use by either side."""

    def __init__(self) -> None:
        self._items: dict[Hashable, deque[T]] = {}
        self._waiters: dict[Hashable, asyncio.Future[T]] = {}

    def put(self, key: Hashable, item: T) -> None:
        """Deliver an item; wakes the waiter of that key if there is one."""
        waiter = self._waiters.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(item)
            return
        self._items.setdefault(key, deque()).append(item)

    async def get(self, key: Hashable) -> T:
        """Take the oldest item under key, waiting for one if needed (one waiter per key)."""
        queue = self._items.get(key)
        if queue:
            item = queue.popleft()
            if not queue:
                del self._items[key]
            return item
        assert key not in self._waiters, f"two waiters on mailbox key {key!r}"
        waiter: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._waiters[key] = waiter
        try:
            return await waiter
        finally:
            if self._waiters.get(key) is waiter:
                del self._waiters[key]

    def peek(self, key: Hashable) -> list[T]:
        """The items queued under key, oldest first, without taking them."""
        return list(self._items.get(key, ()))

    def discard(self, key: Hashable) -> int:
        """Drop every item queued under key; returns how many."""
        return len(self._items.pop(key, ()))

    def discard_where(self, predicate: object) -> int:
        """Drop every queue whose key satisfies predicate(key); returns items dropped."""
        assert callable(predicate)
        keys = [key for key in self._items if predicate(key)]
        return sum(len(self._items.pop(key)) for key in keys)

    def keys(self) -> list[Hashable]:
        return list(self._items)

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._items.values())

    def __repr__(self) -> str:
        return f"<Mailbox keys={len(self._items)} items={len(self)} waiters={len(self._waiters)}>"
