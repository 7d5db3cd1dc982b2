"""Per-key queues filled by a socket's single reader (transport layer).

The reader of a socket never waits on consumers: it puts each message under a key, and
whoever needs that message awaits `get(key)`. Timeouts and cancellation therefore act on
queue waits, never on a half-read socket. Keys live in groups (for collectives, one group
per collective id), so everything left of a finished collective goes in one step.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

__all__ = ["Mailbox"]

T = TypeVar("T")


class Mailbox(Generic[T]):
    """Unbounded FIFO queues, addressed by (group, key), created on first use."""

    def __init__(self) -> None:
        self._groups: dict[Hashable, dict[Hashable, deque[T]]] = {}
        self._waiters: dict[tuple[Hashable, Hashable], deque[asyncio.Future[T]]] = {}

    def put(self, group: Hashable, key: Hashable, item: T) -> None:
        """Deliver an item; wakes the oldest waiter of that key if there is one."""
        waiters = self._waiters.get((group, key))
        while waiters:
            waiter = waiters.popleft()
            if not waiters:
                del self._waiters[(group, key)]
            if not waiter.done():
                waiter.set_result(item)
                return
        self._append(group, key, item)

    def put_back(self, group: Hashable, key: Hashable, item: T) -> None:
        """Return an item taken from (group, key) to the head of its queue (or to the
        oldest waiter: a queue with waiters is empty)."""
        waiters = self._waiters.get((group, key))
        if waiters:
            self.put(group, key, item)
        else:
            self._append(group, key, item, front=True)

    def _append(self, group: Hashable, key: Hashable, item: T, *, front: bool = False) -> None:
        queues = self._groups.get(group)
        if queues is None:
            queues = self._groups[group] = {}
        queue = queues.get(key)
        if queue is None:
            queue = queues[key] = deque()
        if front:
            queue.appendleft(item)
        else:
            queue.append(item)

    async def get(
        self, group: Hashable, key: Hashable, *, unless: asyncio.Future[Any] | None = None
    ) -> T:
        """Take the oldest item under (group, key), waiting for one.

        Several waiters on one key are served in the order they started waiting. A waiter
        cancelled after its item was handed over puts the item back: nothing is lost.
        `unless` is a future whose result is an exception: once it is set, a waiting (or
        later) get raises that exception instead of waiting on. This is how a failure
        reaches the code waiting for a message, as a value rather than a cancellation.
        """
        if unless is not None and unless.done():
            raise unless.result()
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
        waiter: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(address, deque()).append(waiter)

        def give_up(failed: asyncio.Future[Any]) -> None:
            if not waiter.done():
                waiter.set_exception(failed.result())

        if unless is not None:
            unless.add_done_callback(give_up)
        try:
            return await waiter
        except asyncio.CancelledError:
            # Cancelled after the item was handed over: put it back, nothing is lost. (A
            # failure through `unless` reaches only a waiter that had no item yet.)
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._append(group, key, waiter.result(), front=True)
            raise
        finally:
            if unless is not None:
                unless.remove_done_callback(give_up)
            waiters = self._waiters.get(address)
            if waiters is not None and waiter in waiters:
                waiters.remove(waiter)
                if not waiters:
                    del self._waiters[address]

    def count(self, group: Hashable, key: Hashable) -> int:
        """Items queued under (group, key)."""
        return len(self._groups.get(group, {}).get(key, ()))

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

    def discard_where(self, old: Callable[[Hashable], bool]) -> int:
        """Drop every group for which `old(group)` is true; returns how many items."""
        return sum(self.discard(group) for group in [g for g in self._groups if old(g)])

    def groups(self) -> list[Hashable]:
        return list(self._groups)

    def __len__(self) -> int:
        return sum(len(q) for queues in self._groups.values() for q in queues.values())

    def __repr__(self) -> str:
        return (
            f"<Mailbox groups={len(self._groups)} items={len(self)} waiters={len(self._waiters)}>"
        )
