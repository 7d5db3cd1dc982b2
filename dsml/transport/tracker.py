"""Waiting until ZeroMQ has released buffers sent without copying (transport layer).

A buffer handed to ZeroMQ with `copy=False` is read by the I/O thread after `send` returns;
writing into it before ZeroMQ is done silently changes what the peer receives. pyzmq signals
"done" with a `threading.Event` set from its garbage-collector thread and offers no asyncio
hook, so we poll it with a short, growing sleep. By the time an algorithm wants to reuse a
buffer the send is nearly always long finished, so the poll rarely runs more than once.

At interpreter exit, pyzmq stops that collector thread (an `atexit` handler) and closes the
socket that libzmq's I/O thread uses to say "released". A buffer released at that moment
(the last frame of a socket closed just before exit, or one still lingering) makes the I/O
thread send on a socket being closed, and libzmq aborts the process ("Assertion failed:
pfd.revents & POLLIN"). So dsml registers its own exit handler, which runs first, and waits
there until libzmq holds no buffer of ours (`drain_zero_copy`).
"""

from __future__ import annotations

import asyncio
import atexit
import time
from collections.abc import Iterable

import zmq
import zmq.utils.garbage as _zmq_gc

__all__ = ["Sent", "drain_zero_copy", "wait_sent"]

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


#: Longest wait at exit: the longest linger dsml closes a socket with (1 s), and a margin.
_DRAIN_AT_EXIT_S = 2.0


def _held_zero_copy() -> int:
    """How many buffers sent without copying libzmq still holds (in this process)."""
    return len(getattr(_zmq_gc.gc, "refs", ()))


def drain_zero_copy(timeout: float = _DRAIN_AT_EXIT_S) -> bool:
    """Wait until libzmq has released every buffer sent without copying, at most `timeout`
    seconds; True if it has.

    Buffers queued on a socket that is still open (never closed) to a peer that does not
    read may never be released; after `timeout` the exit goes on regardless.
    """
    deadline = time.monotonic() + timeout
    while _held_zero_copy():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)
    return True


# atexit runs handlers last-registered first: importing zmq.utils.garbage above registered
# pyzmq's collector shutdown, so this one runs before it.
atexit.register(drain_zero_copy)
