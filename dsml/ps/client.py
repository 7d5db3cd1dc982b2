"""The worker side: push and pull with handles, batched per server (parameter-server layer).

Calls made in the same turn of the event loop go into one batch per server, sent as one
`Request` on the next turn (`flush`), so a step that pushes every gradient and pulls every
parameter is one message per server, not one per tensor. Each server has a `_Link` that
sends one request at a time and waits for its reply; after a change of view it sends the
same request again (same number: its pushes are applied once). A server that is lost
fails the request with `ServerLostError`, and every later request to it at once; with
replicas, the link sends to the shard's backup instead (`dsml.ps.replica`) and fails only
once both are lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..communicator import Communicator
from ..errors import (
    CollectiveAbortedError,
    ConfigError,
    MemberLeftError,
    MembershipChangedError,
    ProtocolError,
)
from .errors import PSError, ServerLostError
from .layout import Layout, Piece
from .messages import DONE, STEP, Reply, decode_reply, encode_request
from .push_codec import PlainPush, PushCodec
from .roles import Roles, retry_pause, wait_next_view
from .server import tags_of

__all__ = ["Client", "PSHandle"]

log = logging.getLogger("dsml.ps")


class PSHandle:
    """The outcome of one push or pull: `await handle`, `done()`, `exception()`.

    A push need not be awaited: if it fails, so does every later call to that server,
    with the same error, so nothing is lost by not looking (asyncio is not asked to warn).
    """

    def __init__(self, future: asyncio.Future[None], what: str, parts: int) -> None:
        self._future, self.what, self._left = future, what, parts
        future.add_done_callback(_seen)
        if parts == 0:
            future.set_result(None)

    def __await__(self) -> Generator[Any, None, None]:
        return self._future.__await__()

    def done(self) -> bool:
        return self._future.done()

    def exception(self) -> BaseException | None:
        return self._future.exception()

    def _part_done(self) -> None:
        self._left -= 1
        if self._left == 0 and not self._future.done():
            self._future.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if not self._future.done():
            self._future.set_exception(exc)

    def __repr__(self) -> str:
        state = "done" if self.done() else f"{self._left} parts left"
        return f"<PSHandle {self.what}: {state}>"


def _seen(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: see PSHandle


@dataclass
class _Batch:
    """What the next request to one server carries."""

    push: list[tuple[Piece, np.ndarray]] = field(default_factory=list)
    pull: list[tuple[Piece, np.ndarray]] = field(default_factory=list)  # (piece, flat out)
    handles: list[PSHandle] = field(default_factory=list)  # one part each
    pulled: set[int] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.push or self.pull)


@dataclass
class _Outstanding:
    seq: int
    buf: np.ndarray
    pull: list[tuple[Piece, np.ndarray]]
    handles: list[PSHandle]

    def complete(self, reply: Reply) -> None:
        got = {piece.index: value for piece, value in reply.values}
        for piece, out in self.pull:
            if piece.index not in got:
                raise ProtocolError(f"a reply lacks piece {piece.index} of {piece.key!r}")
            out[piece.lo : piece.hi] = got[piece.index]
        for handle in self.handles:
            handle._part_done()

    def fail(self, exc: BaseException) -> None:
        for handle in self.handles:
            handle._fail(exc)


class _Link:
    """One worker's requests to one server, one at a time, in order."""

    def __init__(
        self,
        comm: Communicator,
        roles: Roles,
        server: int,
        layout: Layout,
        timeout_s: float,
        backup: int | None = None,
    ) -> None:
        self._comm, self._roles, self.server = comm, roles, server
        self._layout, self._timeout_s = layout, timeout_s
        self._holders = [roles.servers[server]]  # the primary, then its backup if any
        if backup is not None:
            self._holders.append(roles.servers[backup])
        self._tags = tags_of(server)
        self._queue: asyncio.Queue[_Outstanding | None] = asyncio.Queue()
        self._seq = 0
        self.sent_bytes = self.received_bytes = 0  # request and reply payloads, resends included
        self._broken: BaseException | None = None
        self.task = asyncio.get_running_loop().create_task(self._run())

    def submit(self, kind: int, batch: _Batch) -> None:
        self._seq += 1
        buf = encode_request(kind, self._seq, batch.push, [p for p, _ in batch.pull])
        self._queue.put_nowait(_Outstanding(self._seq, buf, batch.pull, batch.handles))

    def close(self) -> None:
        self._queue.put_nowait(None)

    async def _run(self) -> None:
        while (request := await self._queue.get()) is not None:
            if self._broken is not None:
                request.fail(self._broken)
                continue
            try:
                request.complete(await self._exchange(request))
            except Exception as exc:  # delivered where the caller waits, never a silent hang
                self._broken = exc  # the stream to this server is out of step from here on
                request.fail(exc)
        while not self._queue.empty():  # close() came after an error: nothing is left waiting
            left = self._queue.get_nowait()
            if left is not None:
                left.fail(self._broken or PSError("the parameter-server client was closed"))

    def _rank(self) -> int:
        """The rank that holds this shard in the current view: its primary, else its backup."""
        for member in self._holders:
            rank = self._comm.view.rank_of(member)
            if rank is not None:
                return rank
        lost = "and its backup were" if len(self._holders) > 1 else "was"
        raise ServerLostError(
            f"parameter server {self.server} {lost} lost: its shard is gone; restart the job "
            "(PSConfig(replicas=1) keeps a copy of each shard on the next server), or "
            "checkpoint the parameters to resume",
            server=self.server,
        )

    async def _exchange(self, request: _Outstanding) -> Reply:
        """Send the request and wait for its reply, again in each new view.

        A rank is looked up right before each call, from the view that call runs in; a
        view that changed while the send was under way means the message may be lost
        with the old view, so it goes again (the server applies its pushes once).
        """
        attempt = 0
        while True:
            try:
                epoch = self._comm.view.epoch
                await self._comm.send(
                    request.buf, self._rank(), tag=self._tags.request, timeout=self._timeout_s
                )
                self.sent_bytes += request.buf.nbytes
                while self._comm.view.epoch == epoch:
                    buf = await self._comm.recv(
                        self._rank(), tag=self._tags.reply, timeout=self._timeout_s
                    )
                    self.received_bytes += buf.nbytes
                    reply = decode_reply(buf, self._layout)
                    if reply.seq >= request.seq:  # below: a duplicate answer to a resent request
                        return self._checked(reply, request)
            except (MemberLeftError, CollectiveAbortedError) as exc:
                if len(self._holders) == 1 or not isinstance(exc, MemberLeftError):
                    raise ServerLostError(
                        f"parameter server {self.server} left before answering: {exc}",
                        server=self.server,
                    ) from exc
                await wait_next_view(self._comm, exc, self._timeout_s)  # the backup answers
            except MembershipChangedError as exc:
                await wait_next_view(self._comm, exc, self._timeout_s)
            await retry_pause(attempt)
            attempt += 1

    def _checked(self, reply: Reply, request: _Outstanding) -> Reply:
        if reply.error is not None:
            raise PSError(f"parameter server {self.server} refused a request: {reply.error}")
        if reply.seq != request.seq:
            raise ProtocolError(f"server {self.server} answered #{reply.seq}, not #{request.seq}")
        return reply


class Client:
    """A worker's push and pull (see the module docstring)."""

    def __init__(
        self,
        comm: Communicator,
        roles: Roles,
        index: int,
        layout: Layout,
        timeout_s: float,
        codec: PushCodec | None = None,
        replicated: bool = False,
    ) -> None:
        self.index, self._layout = index, layout
        self._codec = codec or PlainPush()
        servers = layout.servers
        self._links = [
            _Link(comm, roles, s, layout, timeout_s, (s + 1) % servers if replicated else None)
            for s in range(servers)
        ]
        self._batches = [_Batch() for _ in range(layout.servers)]
        self._flush_due = False
        self._finished = False

    def push(self, key: str, grad: np.ndarray) -> PSHandle:
        """Send a gradient of `key` to its servers (encoded now: grad may change at once)."""
        pieces = self._layout.pieces_of(key)
        flat = _flat(grad, self._layout, key, "grad")

        def add(batch: _Batch, piece: Piece) -> None:
            batch.push.append((piece, self._codec.encode(piece, flat[piece.lo : piece.hi])))

        return self._add(f"push {key!r}", pieces, add, conflicts=lambda b, p: p.index in b.pulled)

    def pull(self, key: str, out: np.ndarray) -> PSHandle:
        """Fill `out` (C-contiguous, the key's shape and dtype) with the key's current value,
        as the table's consistency allows; the handle completes once `out` is written."""
        pieces = self._layout.pieces_of(key)
        flat = _flat(out, self._layout, key, "out", writable=True)

        def add(batch: _Batch, piece: Piece) -> None:
            batch.pull.append((piece, flat))
            batch.pulled.add(piece.index)

        return self._add(f"pull {key!r}", pieces, add, conflicts=lambda b, p: p.index in b.pulled)

    def _add(
        self,
        what: str,
        pieces: tuple[Piece, ...],
        add: Callable[[_Batch, Piece], None],
        conflicts: Callable[[_Batch, Piece], bool],
    ) -> PSHandle:
        if self._finished:
            raise ConfigError(f"{what}: this worker already called finish()")
        handle = PSHandle(asyncio.get_running_loop().create_future(), what, len(pieces))
        for piece in pieces:
            if conflicts(self._batches[piece.server], piece):  # keep program order
                self._send_batch(piece.server, STEP)
            batch = self._batches[piece.server]
            add(batch, piece)
            batch.handles.append(handle)
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self.flush)
        return handle

    def flush(self) -> None:
        """Send every batch now (otherwise done on the next turn of the loop)."""
        self._flush_due = False
        for server in range(len(self._batches)):
            if self._batches[server]:
                self._send_batch(server, STEP)

    def _send_batch(self, server: int, kind: int) -> None:
        batch, self._batches[server] = self._batches[server], _Batch()
        self._links[server].submit(kind, batch)

    async def finish(self, pull: Mapping[str, np.ndarray] | None = None) -> None:
        """Tell every server this worker is done; return once all workers are, with `pull`'s
        arrays filled with the final parameters. No push or pull after this."""
        handles = [self.pull(key, out) for key, out in (pull or {}).items()]
        self._finished = True
        self._flush_due = False
        for server in range(len(self._batches)):
            self._send_batch(server, DONE)
            self._links[server].close()
        await asyncio.gather(*(link.task for link in self._links))
        for handle in handles:
            await handle

    def traffic(self) -> dict[str, int]:
        """Bytes of this worker's request and reply messages so far, over all servers."""
        return {
            "sent_bytes": sum(link.sent_bytes for link in self._links),
            "received_bytes": sum(link.received_bytes for link in self._links),
        }

    async def aclose(self) -> None:
        """Stop the links (requests not answered yet fail with ServerLostError's cause)."""
        for link in self._links:
            if not link.task.done():
                link.task.cancel()
        await asyncio.gather(*(link.task for link in self._links), return_exceptions=True)


def _flat(
    array: np.ndarray, layout: Layout, key: str, name: str, writable: bool = False
) -> np.ndarray:
    """A flat view of array, after checking it matches the key's shape and dtype."""
    spec = layout.keys[key]
    if (
        not isinstance(array, np.ndarray)
        or tuple(array.shape) != spec.shape
        or array.dtype != spec.dtype
    ):
        got = (
            f"{type(array).__name__} {getattr(array, 'shape', '?')} {getattr(array, 'dtype', '?')}"
        )
        raise ConfigError(
            f"{name} for {key!r} must be a numpy array of shape {spec.shape} and dtype "
            f"{spec.dtype}, got {got}"
        )
    if writable and not (array.flags.c_contiguous and array.flags.writeable):
        raise ConfigError(f"{name} for {key!r} must be C-contiguous and writable")
    return array.reshape(-1)
