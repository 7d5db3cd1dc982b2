"""Connection watching: a channel's socket monitor as a disconnect callback (transport).

ZeroMQ reconnects silently, so a peer that died is invisible to a sender until its queue
fills. The monitor of a DEALER socket reports `DISCONNECTED` the moment the TCP connection
drops (a killed process's kernel closes it at once), which is what turns a `kill -9` into a
report within milliseconds instead of a heartbeat timeout. The monitor socket is read by
an event-loop reader callback, like every other dsml socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

__all__ = ["DisconnectWatch"]

log = logging.getLogger("dsml.transport")

_EVENTS, _POLLIN, _FD = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.FD)
_WATCHED = int(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)


class DisconnectWatch:
    """Calls `on_disconnect()` each time the watched socket loses its connection."""

    def __init__(self, sock: zmq.Socket[bytes], on_disconnect: Callable[[], None]) -> None:
        self.disconnects = 0
        self.connected = False
        self._sock = sock
        self._on_disconnect = on_disconnect
        self._monitor: zmq.Socket[bytes] = sock.get_monitor_socket(_WATCHED)
        self._loop = asyncio.get_running_loop()
        self._fd: int = self._monitor.get(_FD)  # type: ignore[assignment]
        self._loop.add_reader(self._fd, self._drain)
        self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        monitor = self._monitor
        while not monitor.closed and monitor.get(_EVENTS) & _POLLIN:  # type: ignore[operator]
            event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            if event["event"] == zmq.EVENT_CONNECTED:
                self.connected = True
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.connected = False
                self.disconnects += 1
                try:
                    self._on_disconnect()
                except Exception:  # a callback bug must not stop the watch
                    log.exception("disconnect callback failed")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._fd)
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(0)
