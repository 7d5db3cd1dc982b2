"""Point-to-point send and recv (communicator layer).

Messages are ordered per (source, destination, tag): each side numbers its sends and
receives per (peer, tag), and a receive checks that the message it takes carries the
number it expects. A message is one ZeroMQ multipart message: the envelope, whose
fingerprint describes dtype and shape, then the payload in frames of `max_frame_bytes`,
or of the peer's where it accepts less (its view record says). The
receiver gets a new array (a single-frame payload is used in place, without a copy) on
`comm.device`. A cupy array is sent through pinned host memory, after the work queued on
the caller's stream. A send this rank refuses (its array: a dtype not supported, too
large) to a valid peer still takes its place in the stream, as a refusal: the matching
receive fails at once with the reason instead of waiting (or taking a later message).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

from ..collectives import DTYPES, NUMPY, backend_of, dtype_name
from ..collectives.chunking import chunk_spans
from ..collectives.devices import is_cupy_array
from ..errors import CollectiveAbortedError, ConfigError, DsmlError, ProtocolError
from ..wire import Envelope, Fields, Fingerprint, Kind
from .call import Call
from .call_table import PEER_LEFT, CallTable
from .placement import Placement
from .plan_base import as_int
from .tasks import TaskOwner

__all__ = ["PointToPoint"]

log = logging.getLogger("dsml.communicator")

Array = Any
_MAX_TAG = (1 << 31) - 1
_CHECK_PEER_S = 0.25  # while a send waits for ZeroMQ, how often to look for a goodbye
_MAX_FRAMES = 4096
_MAX_REASON = 1024  # characters of a refused send's reason that travel to the receiver


class PointToPoint:
    """Sequence numbers and the send/recv bodies for one communicator."""

    def __init__(self, table: CallTable, placement: Placement, tasks: TaskOwner) -> None:
        self._table = table
        self._placement = placement
        self._tasks = tasks  # refusals are sent from tasks of the communicator
        self._refusals: set[asyncio.Task[None]] = set()  # ... not sent yet
        self._sent: Counter[tuple[int, int]] = Counter()
        self._received: Counter[tuple[int, int]] = Counter()

    def reset(self) -> None:
        """A new view: ranks may mean other members, so every stream starts again."""
        self._sent.clear()
        self._received.clear()

    def _check_peer(self, peer: object, tag: object, what: str) -> tuple[int, int]:
        size, rank = self._table.size, self._table.rank
        peer_rank, tag_value = as_int(peer), as_int(tag)
        if peer_rank is None or not 0 <= peer_rank < size or peer_rank == rank:
            verb = "send to" if what == "dst" else "receive from"
            why = (
                f"that is this rank, which cannot {verb} itself"
                if peer_rank == rank
                else f"ranks are 0..{size - 1}"
            )
            raise ConfigError(f"{what}={peer!r} must be another rank of this group ({why})")
        if tag_value is None or not 0 <= tag_value <= _MAX_TAG:
            raise ConfigError(f"tag={tag!r} must be an integer in [0, 2**31)")
        return peer_rank, tag_value

    def plan_send(
        self, x: Array, dst: object, tag: object, caller: Any = None
    ) -> tuple[int, int, Fingerprint, Callable[[Call], Coroutine[Any, Any, None]]]:
        """Validate a send; returns (dst, tag), its fingerprint and the coroutine function
        sending it over its `Call` (whose failure, its deadline, stops the waiting).

        `caller` is the calling thread's current CUDA stream when x is a cupy array.
        """
        dst, tag = self._check_peer(dst, tag, "dst")
        try:
            be = backend_of(x, "x")
            x = be.plain(x)  # a masked array or a matrix: its plain data, as collectives do
            fp = Fingerprint("send", dtype_name(x.dtype), x.size, x.shape)
        except ConfigError as exc:
            self.refuse(dst, tag, str(exc))
            raise
        config, view = self._table.config, self._table.links.view
        # Frames as large as both ends accept: the peer's limit (its view record says it)
        # may be below this rank's.
        frame_bytes = config.max_frame_bytes
        if view is not None and view.members[dst].max_frame > 0:
            frame_bytes = min(frame_bytes, view.members[dst].max_frame)
        frame_elems = max(1, frame_bytes // x.dtype.itemsize)
        if math.ceil(x.size / frame_elems) > _MAX_FRAMES:
            reason = f"send: {x.nbytes} bytes is more than one message may carry"
            self.refuse(dst, tag, reason)
            raise ConfigError(reason)
        if is_cupy_array(x):
            from ..collectives import cuda  # only once a cupy array is seen

            cuda.after_caller(x, caller)  # the payload copies wait for the caller's kernels
        table, links = self._table, self._table.links

        async def send(call: Call) -> None:
            if dst in table.closed_after:
                raise table.peer_left_error(dst, "send to")
            flat = be.flat_view(x)
            if flat is None:
                flat = be.empty(x.size, x.dtype.newbyteorder("="))
                be.copy_flat(x, flat)
            frames = [be.payload(flat, lo, hi) for lo, hi in chunk_spans((0, x.size), frame_elems)]
            # Numbered only now, in the same step as it is queued (sends start in call
            # order), so a send cancelled before it ran leaves no gap in the (dst, tag)
            # stream. If the peer's queue is full the message waits its turn in a task of
            # the links: giving this send up then stops the waiting here, not the message.
            self._sent[(dst, tag)] += 1
            seq = self._sent[(dst, tag)]
            env = Envelope(Kind.PEER_MESSAGE, table.epoch, table.rank, seq, tag, len(frames), fp)
            parts = frames if x.size else []
            receipt = links.try_send(dst, env, parts)
            if receipt is None:
                receipt = await call.unless_failed(links.send_in_turn(dst, env, parts))
            while not receipt.done():  # the caller may modify x once send returns
                if dst in table.closed_after:  # it will never be read
                    raise table.peer_left_error(dst, "send to")
                waiting = asyncio.ensure_future(receipt.wait())
                try:
                    # asyncio.timeout, not wait_for: on 3.11 wait_for can drop a user's
                    # cancel that arrives in the turn the receipt completes.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(_CHECK_PEER_S):
                            await call.unless_failed(waiting)
                finally:
                    waiting.cancel()  # our wait on the tracker only, not the message

        return dst, tag, fp, send

    def refuse(self, dst: int, tag: int, reason: str) -> None:
        """This rank refused a send to a valid peer: the matching receive there must fail
        with the reason, not wait for (or take) the next message of the stream. The
        refusal takes the send's place in the (dst, tag) stream: like a send, it is
        numbered in the first step of a task of its own, so it keeps its place among the
        sends started before and after it, whether tasks start eagerly or not."""
        task = self._tasks.spawn(self._send_refusal(dst, tag, reason))
        self._refusals.add(task)
        task.add_done_callback(self._refusals.discard)

    async def settle(self, timeout_s: float) -> None:
        """Wait (at most timeout_s) for the refusals not sent yet: a rank that closes
        right after a refused send must tell the receiver why before its goodbye does,
        or the receive fails as if the sender had just left."""
        if self._refusals:
            await asyncio.wait(set(self._refusals), timeout=timeout_s)

    async def _send_refusal(self, dst: int, tag: int, reason: str) -> None:
        table = self._table
        self._sent[(dst, tag)] += 1
        env = Envelope(
            Kind.PEER_MESSAGE,
            table.epoch,
            table.rank,
            cid=self._sent[(dst, tag)],
            step=tag,
            fingerprint=Fingerprint("send"),
            body={"rejected": reason[:_MAX_REASON]},
        )
        try:
            if table.links.try_send(dst, env) is None:
                await table.links.send_in_turn(dst, env)  # behind sends waiting for room
        except DsmlError as exc:  # the peer is gone or the links closed: nobody waits
            log.debug("a refusal to rank %d was not sent: %s", dst, exc)

    def give_back(self, taken: list[Any]) -> bool:
        """Put a message a receive took (recorded in `taken`) back at the head of its
        stream, for the next receive: the caller gave the receive up (its await was
        cancelled) after it had the message. Not once a later receive of the stream took
        one, or a new view started the streams again; True if it went back."""
        if not taken:
            return False
        group, src, tag, seq, item = taken
        taken.clear()
        if group != ("p2p", self._table.epoch) or self._received[(src, tag)] != seq:
            log.warning(
                "a recv from rank %d (tag %d) was given up after it took message #%d; a "
                "later recv of the stream (or a new view) came first, so it is dropped",
                src,
                tag,
                seq,
            )
            return False
        self._received[(src, tag)] = seq - 1
        self._table.mailbox.put_back(group, (src, tag), item)
        return True

    def plan_recv(self, src: object, tag: object) -> tuple[int, int]:
        """Validate a recv; returns (src, tag)."""
        return self._check_peer(src, tag, "src")

    async def receive(
        self, call: Call, src: int, tag: int, taken: list[Any] | None = None
    ) -> Array:
        """Take the next message from (src, tag) and turn it into a new array.

        Messages are numbered when taken, so a receive that timed out without one leaves
        the stream intact. If src has closed, queued messages are still delivered; after
        them, receiving fails (a `Goodbye` queues a marker behind the last message).
        A message taken is recorded in `taken`, for `give_back`.
        """
        table = self._table
        group = ("p2p", table.epoch)
        if src in table.said_goodbye and not table.mailbox.count(group, (src, tag)):
            raise table.peer_left_error(src, "recv from")
        env, frames = await table.mailbox.get(group, (src, tag), unless=call.failed)
        if env is PEER_LEFT:  # src closed after its last message
            table.mailbox.put(group, (src, tag), (env, frames))  # for later receives
            raise table.peer_left_error(src, "recv from")
        seq = self._received[(src, tag)] + 1
        fp = env.fingerprint
        if env.cid != seq:
            raise ProtocolError(f"message #{env.cid} from rank {src} (tag {tag}) arrived as #{seq}")
        self._received[(src, tag)] = seq
        if taken is not None:
            taken[:] = [group, src, tag, seq, (env, frames)]
        if env.body is not None and "rejected" in env.body:
            reason = Fields(env.body, "PeerMessage").get_str("rejected", _MAX_REASON)
            raise CollectiveAbortedError(
                f"recv from rank {src} (tag {tag}): rank {src} refused the matching send: {reason}",
                origin=src,
                rank=table.rank,
                epoch=table.epoch,
                collective="recv",
            )
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
