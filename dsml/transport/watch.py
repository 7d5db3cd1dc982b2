"""Connection watching: a channel's socket monitor as callbacks (transport layer).

ZeroMQ reconnects silently, so a peer that died is invisible to a sender until its queue
fills. The monitor of a DEALER socket reports `DISCONNECTED` the moment the TCP connection
drops (a killed process's kernel closes it at once), which is what turns a `kill -9` into a
report within milliseconds instead of a heartbeat timeout. The monitor also
reports handshakes the server refused, which would otherwise look like a peer that never
answers. And a first connection that keeps failing (nothing listens at that address: the
process is gone) is reported after a few attempts, instead of messages queueing forever.
The monitor socket is read by an event-loop reader callback, like every other dsml socket.
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
_RETRIED = int(zmq.EVENT_CONNECT_RETRIED)
#: Failed attempts at a first connection before `on_unreachable` (libzmq retries every
#: 100 ms or so; a refused loopback connection fails within microseconds).
UNREACHABLE_AFTER = 2
_CURVE_ELSEWHERE = (
    "handshake failed: the other end uses CURVE (give this process the cluster's keys: "
    "--curve-keys DIR or DSML_CURVE_KEYS)"
)
#: What each handshake failure means to the user (the monitor's words are libzmq's).
_REFUSALS = {
    "CURVE": {
        int(zmq.EVENT_HANDSHAKE_FAILED_AUTH): (
            "the server refused this key (not allowlisted: is this client's public key in its "
            "DIR/authorized list?)"
        ),
        int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL): (
            "CURVE handshake failed (is CURVE on at both ends?)"
        ),
        int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL): (
            "CURVE handshake failed (is CURVE on at both ends?)"
        ),
    },
    "PLAIN": {
        int(zmq.EVENT_HANDSHAKE_FAILED_AUTH): (
            "another job's secret: every process of a job needs the same DSML_SECRET (or "
            "DSML_SECRET_FILE, or per-user secret file ~/.config/dsml/secret)"
        ),
        int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL): _CURVE_ELSEWHERE,
        int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL): _CURVE_ELSEWHERE,
    },
}
_HANDSHAKE = int(
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class DisconnectWatch:
    """Calls `on_disconnect()` each time the watched socket loses its connection,
    `on_refused(reason)` when a handshake fails, and `on_unreachable()` once when the first
    connection failed `UNREACHABLE_AFTER` times (refused or reset: nothing listens there).

    After a refused key or a mechanism mismatch libzmq gives the connection up for good
    (`refused` keeps the reason); a server that cannot answer the handshake (no ZAP
    handler) fails every reconnection attempt instead, about ten times a second.
    `on_refused` hears of a reason once, and again only after a handshake succeeded or the
    reason changed; `refusals` counts them all.
    """

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        on_disconnect: Callable[[], None] | None = None,
        *,
        on_refused: Callable[[str], None] | None = None,
        on_unreachable: Callable[[], None] | None = None,
        handshakes: bool = False,
        mechanism: str = "CURVE",
    ) -> None:
        """Watch `sock`; handshakes too when `handshakes` or `on_refused` is given."""
        self.disconnects = 0
        self.refusals = 0
        self.failed_connects = 0  # attempts at a first connection that failed
        self.connected = False
        self.ever_connected = False
        self._sock = sock
        self._on_disconnect = on_disconnect
        self._on_refused = on_refused
        self._on_unreachable = on_unreachable
        self.refused: str | None = None  # why the last handshake failed; None once one succeeds
        self._refusals = _REFUSALS[mechanism]
        watched = _WATCHED | (_HANDSHAKE if handshakes or on_refused is not None else 0)
        watched |= _RETRIED if on_unreachable is not None else 0
        self._monitor: zmq.Socket[bytes] = sock.get_monitor_socket(watched)
        self._loop = asyncio.get_running_loop()
        self._fd: int = self._monitor.get(_FD)  # type: ignore[assignment]
        self._loop.add_reader(self._fd, self._drain)
        self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        monitor = self._monitor
        while not monitor.closed and monitor.get(_EVENTS) & _POLLIN:  # type: ignore[operator]
            event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            kind = int(event["event"])
            if kind == zmq.EVENT_CONNECTED:
                self.connected = self.ever_connected = True
            elif kind == _RETRIED:
                # Also sent before reconnecting after a drop: only a first connection counts.
                if not self.ever_connected:
                    self.failed_connects += 1
                    if self.failed_connects == UNREACHABLE_AFTER:
                        self._call(self._on_unreachable)
            elif kind == zmq.EVENT_DISCONNECTED:
                self.connected = False
                self.disconnects += 1
                self._call(self._on_disconnect)
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.refused = None
            elif kind in self._refusals:
                self.refusals += 1
                reason = self._refusals[kind]
                if reason != self.refused:  # once, until a handshake succeeds or it changes
                    self.refused = reason
                    self._call(self._on_refused, reason)

    @staticmethod
    def _call(callback: Callable[..., None] | None, *args: str) -> None:
        if callback is None:
            return
        try:
            callback(*args)
        except Exception:  # a callback bug must not stop the watch
            log.exception("connection callback failed")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._fd)
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(0)

    def __repr__(self) -> str:
        state = "connected" if self.connected else "not connected"
        return (
            f"<DisconnectWatch {state} disconnects={self.disconnects} "
            f"refusals={self.refusals} failed_connects={self.failed_connects}>"
        )
