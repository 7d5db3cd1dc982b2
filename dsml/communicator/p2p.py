"""Point-to-point send and recv (communicator layer).

Messages are ordered per (source, destination, tag): each side numbers its sends and
receives per (peer, tag), and a receive checks that the message it takes carries the
number it expects. A message is one ZeroMQ multipart message: the envelope, whose
fingerprint describes dtype and shape, then the payload in frames of at most
`max_frame_bytes`. The receiver gets a new array (a single-frame payload is used in place,
without a copy) on `comm.device`. A cupy array is sent through pinned host memory, after
the work queued on the caller's stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import Counter
from typing import Any

from ..collectives import DTYPES, NUMPY, backend_of, dtype_name
from ..collectives.chunking import chunk_spans
from ..collectives.devices import is_cupy_array
from ..errors import ConfigError, ProtocolError
from ..wire import Envelope, Fingerprint, Kind
from .mesh import PEER_LEFT, Mesh
from .placement import Placement

__all__ = ["PointToPoint"]

Array = Any
_MAX_TAG = (1 << 31) - 1
_CHECK_PEER_S = 0.25  # while a send waits for ZeroMQ, how often to look for a goodbye
_MAX_FRAMES = 4096


class PointToPoint:
    """Sequence numbers and the send/recv bodies for one communicator."""

    def __init__(self, mesh: Mesh, placement: Placement) -> None:
        self._mesh = mesh
        self._placement = placement
        self._sent: Counter[tuple[int, int]] = Counter()
        self._received: Counter[tuple[int, int]] = Counter()

    def reset(self) -> None:
        """A new view: ranks may mean other members, so every stream starts again."""
        self._sent.clear()
        self._received.clear()

    def _check_peer(self, peer: object, tag: object, what: str) -> tuple[int, int]:
        size, rank = self._mesh.size, self._mesh.rank
        if type(peer) is not int or not 0 <= peer < size or peer == rank:
            raise ConfigError(
                f"{what}={peer!r} must be another rank of this group (0..{size - 1}, not {rank})"
            )
        if type(tag) is not int or not 0 <= tag <= _MAX_TAG:
            raise ConfigError(f"tag={tag!r} must be an integer in [0, 2**31)")
        return peer, tag

    def plan_send(
        self, x: Array, dst: object, tag: object, caller: Any = None
    ) -> tuple[Fingerprint, Any]:
        """Validate a send; returns its fingerprint and the coroutine function sending it.

        `caller` is the calling thread's current CUDA stream when x is a cupy array.
        """
        dst, tag = self._check_peer(dst, tag, "dst")
        be = backend_of(x)
        fp = Fingerprint("send", dtype_name(x.dtype), x.size, x.shape)
        frame_elems = max(1, self._mesh.config.max_frame_bytes // x.dtype.itemsize)
        if math.ceil(x.size / frame_elems) > _MAX_FRAMES:
            raise ConfigError(f"send: {x.nbytes} bytes is more than one message may carry")
        if is_cupy_array(x):
            from ..collectives import cuda  # only once a cupy array is seen

            cuda.after_caller(x, caller)  # the payload copies wait for the caller's kernels
        mesh = self._mesh

        async def send() -> None:
            if dst in mesh.closed_after:
                raise mesh.peer_left_error(dst, "send to")
            flat = be.flat_view(x)
            if flat is None:
                flat = be.empty(x.size, x.dtype.newbyteorder("="))
                be.copy_flat(x, flat)
            frames = [be.payload(flat, lo, hi) for lo, hi in chunk_spans((0, x.size), frame_elems)]
            # Numbered only now, in the same step as it is queued (sends start in call
            # order), so a send cancelled before it ran leaves no gap in the (dst, tag)
            # stream. If the peer's queue is full the message waits its turn in a task of
            # the mesh: cancelling this send then stops the waiting here, not the message.
            self._sent[(dst, tag)] += 1
            seq = self._sent[(dst, tag)]
            env = Envelope(Kind.PEER_MESSAGE, mesh.epoch, mesh.rank, seq, tag, len(frames), fp)
            parts = frames if x.size else []
            receipt = mesh.try_send(dst, env, parts)
            if receipt is None:
                receipt = await asyncio.shield(mesh.send_in_turn(dst, env, parts))
            while not receipt.done():  # the caller may modify x once send returns
                if dst in mesh.closed_after:  # it will never be read
                    raise mesh.peer_left_error(dst, "send to")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(receipt.wait(), _CHECK_PEER_S)

        return fp, send

    def plan_recv(self, src: object, tag: object) -> tuple[int, int]:
        """Validate a recv; returns (src, tag)."""
        return self._check_peer(src, tag, "src")

    async def receive(self, src: int, tag: int) -> Array:
        """Take the next message from (src, tag) and turn it into a new array.

        Messages are numbered when taken, so a receive that timed out without one leaves
        the stream intact. If src has closed, queued messages are still delivered; after
        them, receiving fails (a `Goodbye` queues a marker behind the last message).
        """
        group = ("p2p", self._mesh.epoch)
        if src in self._mesh.closed_after and not self._mesh.mailbox.count(group, (src, tag)):
            raise self._mesh.peer_left_error(src, "recv from")
        env, frames = await self._mesh.mailbox.get(group, (src, tag))
        if env is PEER_LEFT:  # src closed after its last message
            self._mesh.mailbox.put(group, (src, tag), (env, frames))  # for later receives
            raise self._mesh.peer_left_error(src, "recv from")
        seq = self._received[(src, tag)] + 1
        fp = env.fingerprint
        if env.cid != seq:
            raise ProtocolError(f"message #{env.cid} from rank {src} (tag {tag}) arrived as #{seq}")
        self._received[(src, tag)] = seq
        if fp is None or fp.dtype not in DTYPES or fp.shape is None or fp.count is None:
            raise ProtocolError(f"rank {src} sent a message without dtype and shape")
        dtype = DTYPES[fp.dtype]
        nbytes = sum(f.nbytes for f in frames)
        if math.prod(fp.shape) != fp.count or nbytes != fp.count * dtype.itemsize:
            raise ProtocolError(f"rank {src} sent a message whose size does not match its shape")
        be = NUMPY  # received bytes live in host memory
        if len(frames) == 1:
            return await self._placement.on_device(be.view(frames[0], dtype).reshape(fp.shape))
        out = be.empty(fp.count, dtype)
        offset = 0
        for frame in frames:
            n = frame.nbytes // dtype.itemsize
            be.write(out, offset, offset + n, frame)
            offset += n
        return await self._placement.on_device(out.reshape(fp.shape))
