"""How a pushed gradient travels: raw, cast to 2 bytes, or top-k with error feedback
(parameter-server layer, pure).

A worker encodes each pushed piece into bytes (`encode`); the server decodes them back
into a dense gradient of the piece's dtype (`decode`) before its optimizer sees it. The
size of a piece's payload follows from the piece and the codec alone (`payload_nbytes`),
so a request needs no extra header words and a server checks every length. Every rank
builds the same codec from `PSConfig.push_compression`.

| codec | payload of a piece of n elements (itemsize b) |
| --- | --- |
| `none` | n * b |
| `bf16`, `fp16` | 2n |
| `topk:R` | k * (4 + b), k = ceil(R * n): int32 indices, then the values |

Top-k keeps, per piece, what it did not send (the residual) and adds it to the next push
of that piece, so the server applies, over the run, the sum of a worker's gradients minus
only what the worker still holds. Decoding checks indices: only `ProtocolError` escapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import ml_dtypes
import numpy as np

from ..errors import ConfigError, ProtocolError
from .layout import Piece

__all__ = ["CastPush", "PlainPush", "PushCodec", "TopKPush", "push_codec_from"]


class PushCodec(Protocol):
    """Turns a piece's gradient into payload bytes and back."""

    def payload_nbytes(self, piece: Piece) -> int: ...

    def encode(self, piece: Piece, grad: np.ndarray) -> np.ndarray: ...

    def decode(self, piece: Piece, payload: np.ndarray) -> np.ndarray: ...


def _bytes(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


@dataclass(frozen=True)
class PlainPush:
    """The gradient's own bytes."""

    def payload_nbytes(self, piece: Piece) -> int:
        return piece.nbytes

    def encode(self, piece: Piece, grad: np.ndarray) -> np.ndarray:
        return _bytes(np.array(grad, dtype=piece.dtype, copy=True))

    def decode(self, piece: Piece, payload: np.ndarray) -> np.ndarray:
        return payload.view(piece.dtype)


_NARROW: dict[str, np.dtype] = {"bf16": np.dtype(ml_dtypes.bfloat16), "fp16": np.dtype(np.float16)}


@dataclass(frozen=True)
class CastPush:
    """The gradient cast to a 2-byte float ("bf16" or "fp16"), widened by the server."""

    name: str = "bf16"

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(_NARROW[self.name])

    def payload_nbytes(self, piece: Piece) -> int:
        return piece.size * 2

    def encode(self, piece: Piece, grad: np.ndarray) -> np.ndarray:
        return _bytes(grad.astype(self.dtype))

    def decode(self, piece: Piece, payload: np.ndarray) -> np.ndarray:
        return payload.view(self.dtype).astype(piece.dtype)


@dataclass
class TopKPush:
    """The k largest entries of (gradient + residual) as (int32 index, value) pairs."""

    ratio: float = 0.01
    residual: dict[int, np.ndarray] = field(default_factory=dict)  # piece index -> flat

    def k(self, piece: Piece) -> int:
        return min(piece.size, max(1, math.ceil(self.ratio * piece.size)))

    def payload_nbytes(self, piece: Piece) -> int:
        return self.k(piece) * (4 + piece.dtype.itemsize) if piece.size else 0

    def encode(self, piece: Piece, grad: np.ndarray) -> np.ndarray:
        if not piece.size:
            return np.zeros(0, np.uint8)
        acc = grad.astype(piece.dtype) + self.residual.get(piece.index, 0)
        k = self.k(piece)
        index = np.sort(np.argpartition(np.abs(acc), acc.size - k)[acc.size - k :])
        values = acc[index]
        acc[index] = 0
        self.residual[piece.index] = acc
        return np.concatenate([_bytes(index.astype(np.int32)), _bytes(values)])

    def decode(self, piece: Piece, payload: np.ndarray) -> np.ndarray:
        dense = np.zeros(piece.size, piece.dtype)
        if not piece.size:
            return dense
        k = self.k(piece)
        index = payload[: 4 * k].view(np.int32)
        if index.size and (index.min() < 0 or index.max() >= piece.size):
            raise ProtocolError(f"a top-k push of piece {piece.index} has an index out of range")
        dense[index] = (
            payload[4 * k :].copy().view(piece.dtype)
        )  # copy: the values may be unaligned
        return dense


def push_codec_from(spec: str) -> PushCodec:
    """ "none", "bf16", "fp16" or "topk[:RATIO]" (0.01) as a codec."""
    name, _, arg = spec.partition(":")
    if name == "none" and not arg:
        return PlainPush()
    if name in _NARROW and not arg:
        return CastPush(name)
    if name == "topk":
        try:
            ratio = float(arg) if arg else 0.01
        except ValueError:
            ratio = -1.0
        if 0 < ratio <= 1:
            return TopKPush(ratio)
        raise ConfigError(f"push_compression {spec!r}: the top-k ratio must be in (0, 1]")
    raise ConfigError(
        f"push_compression must be none, bf16, fp16 or topk[:RATIO], got {spec!r} (PowerSGD "
        "needs an all_reduce between the workers: use dsml.train with compression='powersgd')"
    )
