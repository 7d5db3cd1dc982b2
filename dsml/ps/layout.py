"""Which server holds which part of which parameter (parameter-server layer, pure).

Every rank computes the same `Layout` from the same parameter specs, so nobody needs to
be told where a key lives. As in ps-lite, keys are sharded *by size*: a key larger than
`max_piece_bytes` (by default a fourth of an even server share, total / (4 * servers)) is cut into
contiguous pieces of its flattened elements, then the pieces go largest first to the
least loaded server (ties: the lowest server index). Each server's load is then at most
an even share plus one piece (the longest-processing-time bound), so a model with one huge
layer no longer lands on one server.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError

__all__ = ["KeySpec", "Layout", "Piece", "shard"]

_MIN_PIECE_BYTES = 4096  # below this, splitting costs more headers than it balances


@dataclass(frozen=True, slots=True)
class KeySpec:
    """A named parameter: its shape and dtype (the values travel separately)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, array: np.ndarray) -> KeySpec:
        return cls(name, tuple(array.shape), np.dtype(array.dtype))


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements [lo, hi) of the flattened key `key`, held by server `server`."""

    index: int
    key: str
    lo: int
    hi: int
    server: int
    dtype: np.dtype

    @property
    def size(self) -> int:
        return self.hi - self.lo

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


@dataclass(frozen=True)
class Layout:
    """The pieces of every key and the server of each piece (same on every rank)."""

    keys: Mapping[str, KeySpec]
    pieces: tuple[Piece, ...]
    servers: int

    def pieces_of(self, key: str) -> tuple[Piece, ...]:
        """The pieces of a key in element order; ConfigError for an unknown key."""
        if key not in self.keys:
            known = ", ".join(sorted(self.keys)) or "none"
            raise ConfigError(f"no parameter named {key!r} on the servers (known: {known})")
        return tuple(p for p in self.pieces if p.key == key)

    def on_server(self, server: int) -> tuple[Piece, ...]:
        return tuple(p for p in self.pieces if p.server == server)

    def load_bytes(self) -> list[int]:
        """Bytes held by each server."""
        loads = [0] * self.servers
        for piece in self.pieces:
            loads[piece.server] += piece.nbytes
        return loads

    def __repr__(self) -> str:
        return (
            f"Layout(keys={len(self.keys)}, pieces={len(self.pieces)}, loads={self.load_bytes()})"
        )


def shard(specs: Sequence[KeySpec], servers: int, max_piece_bytes: int | None = None) -> Layout:
    """Cut the keys into pieces and place them on `servers` servers (see the module)."""
    if servers < 1:
        raise ConfigError(f"servers must be at least 1, got {servers}")
    if len({s.name for s in specs}) != len(specs):
        raise ConfigError("parameter names must be unique")
    total = sum(s.nbytes for s in specs)
    if max_piece_bytes is None:
        max_piece_bytes = max(_MIN_PIECE_BYTES, math.ceil(total / (4 * servers)))
    cuts = [span for spec in specs for span in _cut(spec, max_piece_bytes)]
    # largest first; equal sizes keep key order, so the result is the same on every rank
    order = sorted(range(len(cuts)), key=lambda i: -cuts[i][0].dtype.itemsize * _len(cuts[i]))
    loads = [0] * servers
    placed: dict[int, int] = {}
    for i in order:
        server = min(range(servers), key=lambda s: (loads[s], s))
        placed[i] = server
        loads[server] += cuts[i][0].dtype.itemsize * _len(cuts[i])
    pieces = tuple(
        Piece(i, spec.name, lo, hi, placed[i], spec.dtype) for i, (spec, lo, hi) in enumerate(cuts)
    )
    return Layout({s.name: s for s in specs}, pieces, servers)


def _len(cut: tuple[KeySpec, int, int]) -> int:
    return cut[2] - cut[1]


def _cut(spec: KeySpec, max_piece_bytes: int) -> list[tuple[KeySpec, int, int]]:
    """A key's element spans: as few equal parts as keep each within max_piece_bytes."""
    parts = max(1, math.ceil(spec.nbytes / max_piece_bytes))
    parts = min(parts, max(1, spec.size))
    bounds = [spec.size * i // parts for i in range(parts + 1)]
    return [(spec, lo, hi) for lo, hi in itertools.pairwise(bounds)]
