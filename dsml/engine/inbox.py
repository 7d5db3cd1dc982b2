"""Hand-off of finished pool-thread work to the event loop (engine layer).

Pool threads must not touch the engine's graph (it belongs to the loop thread), so each
one posts what its function returned here. Waking the loop costs a system call, so a
burst of completions shares one wake-up: a thread only schedules a drain when none is
pending, and the drain clears that flag before it empties the queue, so an item posted
while it runs is either seen by this drain or schedules the next one.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Inbox"]

T = TypeVar("T")


class Inbox(Generic[T]):
    """Thread-safe queue whose items are handled on the loop by `handler`, in order."""

    __slots__ = ("_handler", "_items", "_lock", "_loop", "_scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop, handler: Callable[[T], None]) -> None:
        self._loop = loop
        self._handler = handler
        self._items: deque[T] = deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def put(self, item: T) -> None:
        """Post an item from any thread."""
        self._items.append(item)
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            self._scheduled = False
        items = self._items
        try:
            while items:
                self._handler(items.popleft())
        finally:
            if items:  # the handler raised: keep the rest flowing
                self._loop.call_soon(self._drain)

    def __repr__(self) -> str:
        return f"<Inbox queued={len(self._items)} wake_scheduled={self._scheduled}>"
