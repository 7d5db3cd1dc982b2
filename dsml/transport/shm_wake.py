"""Waking a sleeping rank of a shared-memory link (transport layer).

A rank that stopped spinning sets its `SLEEPING` word and waits on its event loop for a
datagram on a socket in Linux's abstract namespace; a peer that posts progress sends one
byte to every peer whose `SLEEPING` word is set. Abstract names need no file and vanish
with the process, so nothing can leak.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

__all__ = ["Waker"]


class Waker:
    """A datagram socket in Linux's abstract namespace that wakes this rank's loop.

    Abstract names need no file and vanish with the process, so nothing can leak. A
    peer sends one byte after posting, only when this rank's `SLEEPING` word says it
    stopped spinning; `wait` returns on that byte or after `backstop_s` (a lost wake-up,
    possible when both sides look at the same moment, costs at most that).
    """

    def __init__(self, name: str) -> None:
        self.name = b"\0" + name.encode()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._sock.bind(self.name)
        self._out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._out.setblocking(False)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sleeper: asyncio.Future[None] | None = None
        self._woken = False

    def start(self) -> None:
        """Start listening on the running loop."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._sock.fileno(), self._readable)

    def _readable(self) -> None:
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while True:
                self._sock.recv(64)
        self._woken = True
        _resolve(self._sleeper)

    def arm(self) -> None:
        """Forget earlier wake-ups (call before announcing that this rank sleeps)."""
        self._woken = False

    async def wait(self, backstop_s: float, unless: asyncio.Future[Any] | None = None) -> None:
        """Until a wake-up byte came (since `arm`), `backstop_s` passed, or `unless` is done."""
        assert self._loop is not None
        if self._woken or (unless is not None and unless.done()):
            return
        sleeper = self._sleeper = self._loop.create_future()
        timer = self._loop.call_later(backstop_s, _resolve, sleeper)
        if unless is not None:
            unless.add_done_callback(lambda _f: _resolve(sleeper))
        try:
            await sleeper
        finally:
            timer.cancel()
            self._sleeper = None

    def wake(self, name: bytes) -> None:
        with contextlib.suppress(OSError):  # full, or the peer is gone: it will look anyway
            self._out.sendto(b"w", name)

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._out.close()


def _resolve(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)
