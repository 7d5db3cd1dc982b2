"""The two messages of the parameter-server protocol (parameter-server layer).

A worker's batch for one server is one `Request`; the server answers each with one
`Reply`. Both travel as a single uint8 array over the communicator's point-to-point
`send`/`recv` (one ZeroMQ multipart message, no pickle): a header of int64 words, then
the pieces' raw bytes, each padded to 8 bytes so every piece starts aligned.

    Request  [MAGIC, kind, seq, n_push, n_pull, push piece ids..., pull piece ids...]
             then the gradient of every pushed piece, in order, as the push codec
             encoded it (`dsml.ps.push_codec`; raw bytes by default)
    Reply    [MAGIC, status, seq, n_pull, pull piece ids...]
             then the value of every pulled piece (status OK), or a UTF-8 reason (ERROR)

Kinds: `STEP` (apply the pushes, answer the pulls when the table's consistency allows),
`DONE` (this worker has finished; answered, with the pulls, once every worker has).
`seq` numbers a worker's requests to one server from 1; a request sent again after a
change of view carries its old number, so the server applies its pushes at most once.
Decoding checks every count and id against the layout: only `ProtocolError` escapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import ProtocolError
from .layout import Layout, Piece
from .push_codec import PlainPush, PushCodec

__all__ = ["DONE", "ERROR", "OK", "STEP", "Reply", "Request", "encode_reply", "encode_request"]

MAGIC = 0x31_53_50_4C_4D_53_44  # "DSMLPS1", little-endian
STEP, DONE = 1, 2
OK, ERROR = 0, 1
_WORD = 8
_MAX_REASON_BYTES = 4096


@dataclass(frozen=True)
class Request:
    """One worker's batch for one server: gradients to apply, pieces to send back."""

    kind: int
    seq: int
    push: tuple[tuple[Piece, np.ndarray], ...]
    pull: tuple[Piece, ...]


@dataclass(frozen=True)
class Reply:
    """The values of the pulled pieces (flat arrays), or the server's reason for refusing."""

    seq: int
    values: tuple[tuple[Piece, np.ndarray], ...]
    error: str | None = None


def _padded(nbytes: int) -> int:
    return -(-nbytes // _WORD) * _WORD


def _pack(words: Sequence[int], arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Header words then each array's bytes (padded) in one new uint8 array: one copy."""
    head = len(words) * _WORD
    out = np.zeros(head + sum(_padded(a.nbytes) for a in arrays), np.uint8)
    out[:head].view(np.int64)[:] = words
    offset = head
    for array in arrays:
        out[offset : offset + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        offset += _padded(array.nbytes)
    return out


def encode_request(
    kind: int, seq: int, push: Sequence[tuple[Piece, np.ndarray]], pull: Sequence[Piece]
) -> np.ndarray:
    words = [MAGIC, kind, seq, len(push), len(pull), *(p.index for p, _ in push)]
    words += [p.index for p in pull]
    return _pack(words, [g for _, g in push])


def encode_reply(seq: int, values: Sequence[tuple[Piece, np.ndarray]]) -> np.ndarray:
    words = [MAGIC, OK, seq, len(values), *(p.index for p, _ in values)]
    return _pack(words, [v for _, v in values])


def encode_error(seq: int, reason: str) -> np.ndarray:
    raw = np.frombuffer(reason.encode()[:_MAX_REASON_BYTES], np.uint8)
    return _pack([MAGIC, ERROR, seq, 0], [raw])


def _header(buf: np.ndarray, fixed: int) -> tuple[np.ndarray, np.ndarray]:
    """(int64 header words so far, the buffer) after checking type, magic and size."""
    if not isinstance(buf, np.ndarray) or buf.dtype != np.uint8 or buf.ndim != 1:
        raise ProtocolError("a parameter-server message must be a flat uint8 array")
    if buf.nbytes < fixed * _WORD or buf.nbytes % _WORD:
        raise ProtocolError(f"a parameter-server message of {buf.nbytes} bytes is malformed")
    words = buf[: fixed * _WORD].view(np.int64)
    if int(words[0]) != MAGIC:
        raise ProtocolError("not a parameter-server message (bad magic number)")
    return words, buf


def _ids(buf: np.ndarray, start: int, count: int, layout: Layout) -> list[Piece]:
    end = start + count
    if count < 0 or end * _WORD > buf.nbytes:
        raise ProtocolError("a parameter-server message lists more pieces than it carries")
    ids = buf[start * _WORD : end * _WORD].view(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= len(layout.pieces)):
        raise ProtocolError("a parameter-server message names a piece that does not exist")
    return [layout.pieces[int(i)] for i in ids]


def _slices(buf: np.ndarray, offset: int, sizes: Sequence[int]) -> list[np.ndarray]:
    """Flat uint8 views of each payload in buf from offset; the sizes must add up exactly."""
    out = []
    for nbytes in sizes:
        if offset + nbytes > buf.nbytes:
            raise ProtocolError("a parameter-server message is shorter than its pieces")
        out.append(buf[offset : offset + nbytes])
        offset += _padded(nbytes)
    if offset != buf.nbytes:
        raise ProtocolError("a parameter-server message is longer than its pieces")
    return out


def decode_request(
    buf: np.ndarray, layout: Layout, server: int, codec: PushCodec | None = None
) -> Request:
    """A worker's request to server `server`, its pushes decoded with `codec` (raw by
    default) into dense gradients; ProtocolError if it is not a valid one."""
    words, buf = _header(buf, 5)
    kind, seq, n_push, n_pull = (int(w) for w in words[1:5])
    if kind not in (STEP, DONE) or seq < 1:
        raise ProtocolError(f"a parameter-server request of kind {kind}, seq {seq} is invalid")
    push = _ids(buf, 5, n_push, layout)
    pull = _ids(buf, 5 + n_push, n_pull, layout)
    if any(p.server != server for p in (*push, *pull)):
        raise ProtocolError(f"a request to server {server} names pieces another server holds")
    codec = codec or PlainPush()
    payloads = _slices(buf, (5 + n_push + n_pull) * _WORD, [codec.payload_nbytes(p) for p in push])
    grads = [codec.decode(piece, raw) for piece, raw in zip(push, payloads, strict=True)]
    return Request(kind, seq, tuple(zip(push, grads, strict=True)), tuple(pull))


def decode_reply(buf: np.ndarray, layout: Layout) -> Reply:
    """A server's reply; ProtocolError if it is not a valid one."""
    words, buf = _header(buf, 4)
    status, seq, n_pull = (int(w) for w in words[1:4])
    if status == ERROR:
        reason = buf[4 * _WORD :].tobytes().rstrip(b"\0").decode(errors="replace")
        return Reply(seq, (), reason)
    if status != OK:
        raise ProtocolError(f"a parameter-server reply has status {status}")
    pieces = _ids(buf, 4, n_pull, layout)
    raw = _slices(buf, (4 + n_pull) * _WORD, [p.nbytes for p in pieces])
    values = [r.view(p.dtype) for p, r in zip(pieces, raw, strict=True)]
    return Reply(seq, tuple(zip(pieces, values, strict=True)))
