"""Frames and non-blocking sends of ZeroMQ sockets (transport layer).

How `Endpoint` and `Channel` (sockets.py) put a message on a socket: the envelope
encoded ahead of the payload, payload buffers large enough wrapped in tracked frames so
they go without copying (a received frame passed on goes as itself, untracked), a send
that never blocks the loop, and, when the queue is full, retries until there is room.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from ..wire import Envelope, encode

# Plain ints: pyzmq's enum flags cost a conversion per frame, which shows on small messages.
_NOBLOCK, _MORE = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)
_FULL_POLL_S = 0.001  # re-try interval of a send that found the queue full (rare)


def _frames(env: Envelope, payload: Sequence[Any]) -> list[Any]:
    return [encode(env), *payload]


def _zero_copy_frames(
    payload: Sequence[Any], threshold: int
) -> tuple[list[Any], zmq.MessageTracker | None]:
    """Wrap the buffers that are large enough to go without copying in tracked frames.

    pyzmq's `send_multipart(track=True)` tracks only the last frame, so each large buffer
    gets its own tracked frame and the receipt watches all of them. A whole received
    frame passed on (the ring's all-gather forwards what arrives; its reduce-scatter
    forwards partial sums written over what arrived) goes as that frame:
    libzmq shares its memory, and with nothing of ours in it there is nothing to track
    (and no hand-back to pyzmq's collector thread when libzmq is done with it).
    """
    parts: list[Any] = []
    tracked: list[zmq.Frame] = []
    for buf in payload:
        nbytes = memoryview(buf).nbytes
        owner = _frame_of(buf) if nbytes >= threshold else None
        if owner is not None and nbytes == len(owner):
            parts.append(owner)
        elif nbytes >= threshold:
            frame = zmq.Frame(buf, copy=False, track=True)
            tracked.append(frame)
            parts.append(frame)
        else:
            parts.append(buf)
    return parts, zmq.MessageTracker(*tracked) if tracked else None


def _frame_of(buf: Any) -> zmq.Frame | None:
    """The received frame whose memory `buf` views, if any (else None).

    Follows memoryview owners and array bases, so a reduction written into a received
    frame (`ArrayBackend.combine`) and sent on as an array's bytes is recognised too. A
    view as long as its frame is the whole frame: views never reach outside their base.
    """
    owner = buf
    for _ in range(8):  # a view of a view of ...: a few levels at most
        if isinstance(owner, zmq.Frame):
            return owner
        nxt = owner.obj if isinstance(owner, memoryview) else getattr(owner, "base", None)
        if nxt is None:
            return None
        owner = nxt
    return None


def _try_send(sock: zmq.Socket[bytes], frames: list[Any]) -> bool:
    """Queue a multipart message without blocking; False (nothing queued) if it is full.

    ZeroMQ checks the high-water mark at the first frame of a message only, so once the
    first frame is queued the others are too.
    """
    last = len(frames) - 1
    try:
        sock.send(frames[0], _MORE if last else _NOBLOCK, copy=False)
    except zmq.Again:
        return False
    for index in range(1, last + 1):
        sock.send(frames[index], _MORE if index < last else _NOBLOCK, copy=False)
    return True


async def _send(sock: zmq.Socket[bytes], frames: list[Any], check: Callable[[], None]) -> None:
    """Send without blocking the loop; when the queue is full, retry until it is not.

    A full queue (100,000 messages) means the peer is gone or far behind, so a 1 ms poll
    costs nothing that matters; watching the descriptor instead would need a second
    reader on a socket that may already have one. `check()` runs before each retry and
    raises to give up.
    """
    while not _try_send(sock, frames):
        check()
        await asyncio.sleep(_FULL_POLL_S)
