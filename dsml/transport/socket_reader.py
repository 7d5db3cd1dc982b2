"""The single reader of one socket (transport layer).

`_Reader` is how an `Endpoint` or a `Channel` (sockets.py) reads: an event-loop reader
callback on the socket's descriptor that drains every queued message, checks its frames
and envelope, and hands it to the socket's `Handler`; malformed messages, and those a
handler rejects, are dropped and counted. ZeroMQ's descriptor signals edges, not levels,
so the reader drains until `EVENTS` says empty, and `kick()` re-checks after a send on
its socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import zmq

from ..errors import ProtocolError
from ..log import Throttle
from ..wire import Envelope, decode

__all__ = ["Handler"]

log = logging.getLogger("dsml.transport")

#: handler(sender_identity, envelope, payload_frames); must not block.
Handler = Callable[[bytes, Envelope, list[memoryview]], None]

_MAX_PAYLOAD_FRAMES = 4096
_BATCH = 256  # messages handled before the reader yields to other tasks
# Plain ints: pyzmq's enum flags cost a conversion per frame, which shows on small messages.
_EVENTS, _POLLIN, _FD = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.FD)
_NOBLOCK = int(zmq.NOBLOCK)
_DROP_LOG_INTERVAL_S = 10.0  # a flood of bad messages: one line per sender per interval


class _Reader:
    """The single reader of one socket: drains it whenever its descriptor fires.

    It runs as an event-loop reader callback rather than as a task: a task would cost one
    more scheduling round per wake-up, which on loopback is a measurable share of a small
    collective. After `_BATCH` messages it re-schedules itself so other work can run.
    """

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        handler: Handler,
        *,
        routed: bool,
        max_envelope_bytes: int,
        name: str,
        bound_identity: bool = False,
    ) -> None:
        self.dropped = 0
        self.received = 0
        #: messages whose routing identity was not the name their connection proved
        self.impostors = 0
        self._bound = bound_identity
        self.name = name
        self._sock = sock
        self._handler = handler
        self._routed = routed
        self._max_envelope_bytes = max_envelope_bytes
        self._drop_log = Throttle(_DROP_LOG_INTERVAL_S)
        self._scheduled = False
        self._closed = False
        self._loop = asyncio.get_running_loop()
        self._fd: int = sock.get(_FD)  # type: ignore[assignment]
        self._loop.add_reader(self._fd, self._on_readable)
        self._schedule()  # messages may already be queued

    def kick(self) -> None:
        """Re-check the socket: a send on it may have consumed the readable edge."""
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled and not self._closed:
            self._scheduled = True
            self._loop.call_soon(self._on_readable)

    def _on_readable(self) -> None:
        self._scheduled = False
        if self._closed:
            return
        sock = self._sock
        for _ in range(_BATCH):
            if not sock.get(_EVENTS) & _POLLIN:  # type: ignore[operator]
                return
            frame = sock.recv(_NOBLOCK, copy=False)
            frames = [frame]
            while frame.more:  # the rest of a multipart message is already here
                frame = sock.recv(_NOBLOCK, copy=False)
                frames.append(frame)
            self.received += 1
            self._dispatch(frames)
        self._schedule()  # more may be queued: go on after others had a turn

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        sender = frames[0].bytes if self._routed else b""
        if self._bound:  # the name the connection proved (zap.py), per message: a
            user: str = frames[0].get("User-Id")  # type: ignore[assignment]
            if user.encode() != sender:  # handover may have moved the identity since
                self._impostor(sender, user)
                return
        parts = frames[1:] if self._routed else frames
        try:
            if not parts or len(parts) > _MAX_PAYLOAD_FRAMES + 1:
                raise ProtocolError(f"message of {len(parts)} frames")
            env = decode(parts[0].buffer, max_bytes=self._max_envelope_bytes)
        except ProtocolError as exc:
            self.dropped += 1
            self._drop_log.warning(
                log, sender, "dropped a malformed message from %r: %s", sender[:32], exc
            )
            return
        try:
            self._handler(sender, env, [frame.buffer for frame in parts[1:]])
        except ProtocolError as exc:
            self.dropped += 1
            self._drop_log.warning(
                log, sender, "dropped a %s message from %r: %s", env.kind.name, sender[:32], exc
            )
        except Exception:  # a handler bug must not kill the only reader of the socket
            self.dropped += 1
            log.exception("handler failed on a %s message; message dropped", env.kind.name)

    def _impostor(self, sender: bytes, user: str) -> None:
        """A connection authenticated as `user` sent under another member's identity."""
        self.dropped += 1
        self.impostors += 1
        self._drop_log.warning(
            log,
            b"impostor:" + sender,
            "dropped a message claiming to be %r from a connection authenticated as %r",
            sender[:32],
            user[:32],
        )

    async def aclose(self) -> None:
        self._closed = True
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._fd)
