"""Endpoints (bound ROUTER) and channels (connected DEALER) (transport layer).

An `Endpoint` is what a worker or the registry binds: a ROUTER socket with exactly one
reader task that validates each incoming message and hands it to a handler together with
the sender's routing identity. A `Channel` is a DEALER connected to someone else's
endpoint; it sends, and (for request/reply with the registry) may have a reader of its own.

Messages are `[envelope, payload...]`. Payload frames at least `copy_threshold` bytes long
are sent without copying; the returned `Sent` says when the buffer may be written again.
Received payloads are `memoryview`s over ZeroMQ's own frames, reduced from directly.

asyncio integration: sockets are used with NOBLOCK only. A reader is called when the
socket's file descriptor becomes readable and drains every queued message. ZeroMQ's
descriptor signals edges, not levels, and any send or recv on the socket may consume the
edge, so the reader drains until `EVENTS` says empty and is nudged after every send on its
socket.

Every connection authenticates before any of its messages is read. By default an
endpoint is a PLAIN server that admits only connections proving the job secret
(secret.py, zap.py), and its reader drops (and counts) any message whose routing identity
is not the name its connection authenticated as; a channel presents that proof for its
own identity. With a `Curve`, an endpoint is a CURVE server that admits only allowlisted
keys and a channel a CURVE client. Endpoints hand an identity over to a newer
authenticated connection (`ROUTER_HANDOVER`): a member that reconnects takes its identity
back instead of being ignored.

The reader of each socket is in socket_reader.py, the frames and non-blocking sends in
socket_send.py; the endpoint and the channel over them, and waiting for a closed
endpoint's socket to be destroyed, are here.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from ..errors import ConfigError, DsmlError
from ..wire import MAX_ENVELOPE_BYTES, Envelope
from .context import check_address, new_socket, use_family
from .curve import Curve, make_curve_client, make_curve_server
from .secret import JobSecret, job_secret
from .socket_reader import _EVENTS, _FD, _NOBLOCK, _POLLIN, Handler, _Reader
from .socket_send import _frame_of as _frame_of  # tests/test_transport_forward.py
from .socket_send import _frames, _send, _try_send, _zero_copy_frames
from .tracker import DONE, Sent
from .watch import DisconnectWatch
from .zap import make_secret_client, make_secret_server

__all__ = ["Channel", "Endpoint", "Handler"]

log = logging.getLogger("dsml.transport")

_HWM = 100_000
_monitor_ids = itertools.count()  # names of the monitors that watch endpoints close
#: Longest wait for ZeroMQ to destroy a closed endpoint: milliseconds in practice (the
#: waits of seconds once seen in daemon jobs came with the former wait in a thread, which
#: a cancelled close broke; see `_monitor_stopped`). Past the wait, close returns; a
#: caller rebinding that port at once may then find it taken a moment longer.
_CLOSE_WAIT_S = 1.0


class Endpoint:
    """A bound ROUTER socket and its reader; `address` is the resolved bound address."""

    def __init__(
        self, sock: zmq.Socket[bytes], address: str, reader: _Reader, *, curve: bool = False
    ) -> None:
        self._sock = sock
        self._reader = reader
        self._curve = curve
        self.address = address

    @classmethod
    def bind(
        cls,
        address: str,
        handler: Handler,
        *,
        max_frame_bytes: int,
        max_envelope_bytes: int = MAX_ENVELOPE_BYTES,
        name: str = "endpoint",
        curve: Curve | None = None,
        secret: JobSecret | None = None,
        rcvhwm: int = _HWM,
        sndhwm: int = _HWM,
    ) -> Endpoint:
        """Bind address (port 0: the OS chooses) and start the reader task.

        Only connections that prove `secret` (by default the process's, `job_secret()`)
        get through, and a message reaches the handler only if its routing identity is the
        name its connection authenticated as. With `curve`, only clients whose public key
        is in `curve.authorized` (read now) get through instead. Others' messages never
        reach the handler. `rcvhwm` caps the messages queued per connected peer before
        ZeroMQ stops reading from it (backpressure); `sndhwm` those queued to one peer
        before `send_nowait` drops (a peer that does not read).
        """
        check_address(address, "bind address")
        _refuse_live_ipc(address)
        sock = new_socket(
            zmq.ROUTER,
            MAXMSGSIZE=max_frame_bytes,
            RCVHWM=rcvhwm,
            SNDHWM=sndhwm,
            ROUTER_MANDATORY=1,
            ROUTER_HANDOVER=1,
        )
        try:
            use_family(sock, address)
            if curve is not None:
                make_curve_server(sock, curve)
            else:
                make_secret_server(sock, secret or job_secret())
            sock.bind(address[:-2] + ":*" if address.endswith(":0") else address)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise ConfigError(f"cannot bind {address}: {exc}") from None
        except BaseException:
            sock.close(0)
            raise
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        reader = _Reader(
            sock,
            handler,
            routed=True,
            max_envelope_bytes=max_envelope_bytes,
            name=name,
            bound_identity=curve is None,
        )
        return cls(sock, bound, reader, curve=curve is not None)

    @property
    def dropped(self) -> int:
        """Malformed or rejected messages dropped so far."""
        return self._reader.dropped

    @property
    def received(self) -> int:
        return self._reader.received

    @property
    def impostors(self) -> int:
        """Messages dropped because their routing identity was not their connection's."""
        return self._reader.impostors

    def reachable(self, identity: bytes, env: Envelope) -> bool:
        """Whether a peer of that identity is connected now (a small message is sent)."""
        try:
            _try_send(self._sock, [identity, *_frames(env, ())])
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            raise
        finally:
            self._reader.kick()
        return True  # sent, or its queue is full: connected either way

    def send_nowait(self, identity: bytes, env: Envelope, payload: Sequence[Any] = ()) -> bool:
        """Send to a connected peer by identity without waiting.

        Returns False (nothing sent) when that peer is not connected or does not read what
        it is sent (its queue is full): one slow peer must not stall replies to others.
        """
        try:
            return _try_send(self._sock, [identity, *_frames(env, payload)])
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            raise DsmlError(f"send on {self.address} failed: {exc}") from None
        finally:
            self._reader.kick()

    async def aclose(self) -> None:
        """Close; returns once the socket is gone and its address can be bound again.

        zmq_close only hands the socket to ZeroMQ's I/O thread, which closes the listening
        descriptor a moment later (later still on a loaded machine): a caller that rebinds
        the port, or a test that checks it is free, must not race that. Cancelling the
        wait is safe: the socket is closed already, only the wait is cut short.
        """
        await self._reader.aclose()
        try:
            monitor = _watch_destruction(self._sock)
        finally:
            self._sock.close(0)
        try:
            # The socket's monitor stops when ZeroMQ destroys the socket, after its listener.
            await _monitor_stopped(monitor)
        finally:
            monitor.close(0)

    def __repr__(self) -> str:
        return (
            f"<Endpoint {self.address} received={self.received} dropped={self.dropped}"
            f"{' CURVE' if self._curve else ''}{' closed' if self._sock.closed else ''}>"
        )


def _watch_destruction(sock: zmq.Socket[bytes]) -> zmq.Socket[bytes]:
    """A socket that hears when ZeroMQ destroys `sock` (after its listeners closed)."""
    # Not get_monitor_socket: its inproc name is made of the socket's descriptor, reused
    # by a socket opened while one closed before is still being torn down (EADDRINUSE).
    address = f"inproc://dsml-closing-{next(_monitor_ids)}"
    sock.monitor(address, zmq.EVENT_MONITOR_STOPPED)
    monitor: zmq.Socket[bytes] = sock.context.socket(zmq.PAIR)
    monitor.setsockopt(zmq.LINGER, 0)
    monitor.connect(address)
    return monitor


async def _monitor_stopped(monitor: zmq.Socket[bytes]) -> None:
    """Until `monitor` reports that its socket was destroyed (or _CLOSE_WAIT_S passed).

    Read on the event loop like every other socket, not by a blocking recv in a thread: a
    cancelled wait (a daemon job cancelled while its communicator closes) would otherwise
    close the monitor under that thread's recv, and libzmq aborts the whole process
    ("Assertion failed: pfd.revents & POLLIN (src/signaler.cpp)").
    """
    loop = asyncio.get_running_loop()
    stopped: asyncio.Future[None] = loop.create_future()

    def drain() -> None:  # the descriptor signals edges: read until EVENTS says empty
        while not stopped.done() and monitor.get(_EVENTS) & _POLLIN:  # type: ignore[operator]
            event = monitor.recv_multipart(_NOBLOCK)[0]
            if int.from_bytes(event[:2], "little") == zmq.EVENT_MONITOR_STOPPED:
                stopped.set_result(None)

    fd: int = monitor.get(_FD)  # type: ignore[assignment]
    loop.add_reader(fd, drain)
    try:
        drain()  # the event may have come before the reader was added
        async with asyncio.timeout(_CLOSE_WAIT_S):
            await stopped
    except TimeoutError:  # rare (see _CLOSE_WAIT_S); a close must not hang on it
        log.info("a closed socket was not destroyed within %g s", _CLOSE_WAIT_S)
    finally:
        loop.remove_reader(fd)


class Channel:
    """A DEALER connected to one remote endpoint, identifying itself as `identity`."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        address: str,
        threshold: int,
        reader: _Reader | None,
        watch: DisconnectWatch | None = None,
    ) -> None:
        self._sock = sock
        self._threshold = threshold
        self._reader = reader
        self._watch = watch
        self.address = address

    @classmethod
    def connect(
        cls,
        address: str,
        identity: bytes,
        *,
        copy_threshold: int = 64 * 1024,
        handler: Handler | None = None,
        max_frame_bytes: int = 64 << 20,
        linger_s: float = 1.0,
        on_disconnect: Callable[[], None] | None = None,
        curve: Curve | None = None,
        secret: JobSecret | None = None,
        on_refused: Callable[[str], None] | None = None,
        on_unreachable: Callable[[], None] | None = None,
    ) -> Channel:
        """Connect to address; with a handler, also read what the endpoint sends back.

        `on_disconnect()` is called (on the loop) whenever the connection drops. The
        channel proves `secret` (by default the process's) for `identity`; with `curve` it
        is a CURVE client instead. `on_refused(reason)` is called (on the loop) when the
        server refuses the handshake: another job's secret, a key not allowlisted, or
        CURVE on at one end only. What is sent over a refused connection is never delivered; libzmq
        gives such a connection up, so `send` then raises ConfigError instead of waiting.
        `on_unreachable()` is called (on the loop, once) when the first connection keeps
        failing: nothing listens at `address` (libzmq goes on retrying).
        """
        check_address(address, "peer address")
        sock = new_socket(
            zmq.DEALER,
            IDENTITY=identity,
            MAXMSGSIZE=max_frame_bytes,
            SNDHWM=_HWM,
            RCVHWM=_HWM,
            LINGER=int(linger_s * 1000),
        )
        sock.copy_threshold = copy_threshold
        watch = None
        try:
            use_family(sock, address)
            if curve is not None:
                make_curve_client(sock, curve)
            else:
                make_secret_client(sock, identity, secret or job_secret())
            if on_disconnect or on_refused or on_unreachable or curve is not None:
                # Watch before connecting: a refused handshake can be over within microseconds.
                watch = DisconnectWatch(
                    sock,
                    on_disconnect,
                    on_refused=on_refused,
                    on_unreachable=on_unreachable,
                    handshakes=True,
                    mechanism="CURVE" if curve is not None else "PLAIN",
                )
            sock.connect(address)
        except zmq.ZMQError as exc:
            if watch is not None:
                watch.close()
            sock.close(0)
            raise ConfigError(f"cannot connect to {address}: {exc}") from None
        reader = None
        if handler is not None:
            reader = _Reader(
                sock, handler, routed=False, max_envelope_bytes=max_frame_bytes, name="channel"
            )
        return cls(sock, address, copy_threshold, reader, watch)

    async def send(self, env: Envelope, payload: Sequence[Any] = ()) -> Sent:
        """Queue a message; payload frames >= the copy threshold are not copied.

        Returns a receipt: do not modify those payload buffers until `receipt.done()`.
        """
        receipt = self.send_nowait(env, payload)
        if receipt is None:  # the queue is full (a slow or absent peer): wait for room
            parts, tracker = _zero_copy_frames(payload, self._threshold)
            try:
                await _send(self._sock, _frames(env, parts), self._check_refused)
            except zmq.ZMQError as exc:
                raise DsmlError(f"send to {self.address} failed: {exc}") from None
            receipt = DONE if tracker is None else Sent(tracker)
        return receipt

    def _check_refused(self) -> None:
        if self._watch is not None and self._watch.refused is not None:
            raise ConfigError(f"cannot send to {self.address}: {self._watch.refused}")

    def send_nowait(self, env: Envelope, payload: Sequence[Any] = ()) -> Sent | None:
        """`send` when it can be done at once (the usual case); None if the queue is full."""
        parts, tracker = _zero_copy_frames(payload, self._threshold)
        try:
            if not _try_send(self._sock, _frames(env, parts)):
                return None
        except zmq.ZMQError as exc:
            raise DsmlError(f"send to {self.address} failed: {exc}") from None
        finally:
            if self._reader is not None:
                self._reader.kick()
        return DONE if tracker is None else Sent(tracker)

    @property
    def dropped(self) -> int:
        return self._reader.dropped if self._reader is not None else 0

    async def aclose(self, *, linger_s: float | None = None) -> None:
        """Close; queued messages still get `linger_s` seconds to leave."""
        if self._reader is not None:
            await self._reader.aclose()
        if self._watch is not None:
            self._watch.close()
        linger = None if linger_s is None else int(linger_s * 1000)
        self._sock.close(linger)

    @property
    def closed(self) -> bool:
        return bool(self._sock.closed)

    def __repr__(self) -> str:
        return f"<Channel to {self.address}{' closed' if self.closed else ''}>"


def _refuse_live_ipc(address: str) -> None:
    """An ipc:// path something still listens on is in use: ZeroMQ would unlink it and
    bind anew, silently cutting that endpoint (a running registry) off. A stale file (a
    socket nobody listens on) is fine to bind over, as a crashed process leaves one."""
    if not address.startswith("ipc://"):
        return
    path = address[len("ipc://") :]
    if not path or path.startswith("@") or not os.path.exists(path):  # "@": abstract
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError:
        return  # refused (stale), or not a socket: ZeroMQ says what it thinks of it
    finally:
        probe.close()
    raise ConfigError(f"cannot bind {address}: something is listening there already")
