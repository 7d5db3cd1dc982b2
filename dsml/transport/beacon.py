"""Heartbeats from a thread of their own (transport layer).

A worker's event loop can be busy for seconds (a long numpy step run inline from a
notebook cell); that worker is slow, not dead, and must not be evicted. So heartbeats come
from a small thread with its own DEALER socket: they stop only when the process stops
(killed, or paused with SIGSTOP), which is exactly what the registry needs to know. The
thread only sends; answers arrive on the member's ordinary registry channel. The socket
proves the job secret like the member's other channels (with a `Curve`, it is a CURVE
client like them).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq

from ..wire import Envelope, encode
from .context import check_address, new_socket, use_family
from .curve import Curve, make_curve_client
from .secret import JobSecret, job_secret
from .zap import make_secret_client

__all__ = ["Beacon"]

log = logging.getLogger("dsml.transport")


class Beacon:
    """Sends `make()` to `address` every `interval` seconds until `stop()`."""

    def __init__(
        self,
        address: str,
        identity: bytes,
        interval: float,
        make: Callable[[], Envelope],
        *,
        curve: Curve | None = None,
        secret: JobSecret | None = None,
    ) -> None:
        check_address(address, "registry address")
        self.address = address
        self.interval = interval
        self.sent = 0
        self._identity = identity
        self._make = make
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._wake = threading.Event()
        self._sock: zmq.Socket[bytes] = new_socket(
            zmq.DEALER, IDENTITY=identity, SNDHWM=16, LINGER=0
        )
        if curve is not None:
            make_curve_client(self._sock, curve)
        else:
            make_secret_client(self._sock, identity, secret or job_secret())
        use_family(self._sock, address)
        self._sock.connect(address)
        self._thread = threading.Thread(target=self._run, name="dsml-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._paused.is_set():
                    self._beat()
                self._wake.wait(self.interval)
                self._wake.clear()
        finally:
            self._sock.close(0)

    def _beat(self) -> None:
        try:
            self._sock.send(encode(self._make()), zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:
            pass  # the registry is away: the queue keeps the last few; nothing to wait for
        except Exception:
            log.exception("heartbeat failed")

    def beat_now(self) -> None:
        """Send the next heartbeat at once (after a change worth reporting)."""
        self._wake.set()

    def pause(self, paused: bool = True) -> None:
        """Stop (or resume) beating without stopping the thread: tests simulate a hang."""
        if paused:
            self._paused.set()
        else:
            self._paused.clear()
            self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def __repr__(self) -> str:
        return f"<Beacon to {self.address} every {self.interval:g} s sent={self.sent}>"
