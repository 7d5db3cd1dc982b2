"""Waiting until ZeroMQ has released buffers sent without copying (transport layer).

A buffer handed to ZeroMQ with `copy=False` is read by the I/O thread after `send` returns;
writing into it before ZeroMQ is done silently changes what the peer receives. pyzmq signals
"done" with a `threading.Event` set from its garbage-collector thread and offers no asyncio
hook, so we poll it with a short, growing sleep. By the time an algorithm wants to reuse a
buffer the send is nearly always long finished, so the poll rarely runs more than once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import zmq

__all__ = ["Sent", "wait_sent"]

_FIRST_POLL_S = 0.0001
_MAX_POLL_S = 0.005


class Sent:
    """Receipt of one send: `done()` once ZeroMQ no longer needs the payload buffers."""

    __slots__ = ("_tracker",)

    def __init__(self, tracker: zmq.MessageTracker | None) -> None:
        self._tracker = tracker

    def done(self) -> bool:
        return self._tracker is None or self._tracker.done

    async def wait(self) -> None:
        """Return once the payload buffers may be modified again."""
        delay = _FIRST_POLL_S
        while not self.done():
            await asyncio.sleep(delay)
            delay = min(delay * 2, _MAX_POLL_S)


DONE = Sent(None)


async def wait_sent(receipts: Iterable[Sent]) -> None:
    """Wait for every receipt (see `Sent.wait`)."""
    for receipt in receipts:
        if not receipt.done():
            await receipt.wait()
