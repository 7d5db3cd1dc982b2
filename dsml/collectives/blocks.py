"""Sending and receiving variable-length blocks of rows (collectives layer).

gather, all_gather, scatter and all_to_all move blocks whose first-axis length may differ
per rank. The first chunk of a block carries `rows` (and, where the receiver cannot know
them, the dtype and trailing shape); the receiver derives the chunk table from it and
checks every later chunk against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ProtocolError
from ..wire import Fields
from .arrays import Array, ArrayBackend
from .chunking import chunk_spans
from .group import Group, Receipt, chunk_elems
from .ops import DTYPES

__all__ = ["Block", "assemble", "recv_block", "send_block"]

_MAX_ROWS = 1 << 48


@dataclass(frozen=True, slots=True)
class Block:
    """A received block: rows, layout, and its payload pieces in order."""

    rows: int
    dtype: np.dtype[Any]
    trailing: tuple[int, ...]
    pieces: list[memoryview]


async def send_block(
    group: Group,
    be: ArrayBackend,
    peer: int,
    step: int,
    block: Array,
    rows: int,
    trailing: tuple[int, ...] | None = None,
) -> list[Receipt]:
    """Send a flat block of `rows` rows; with `trailing`, also describe dtype and shape."""
    meta: dict[str, Any] = {"rows": rows}
    if trailing is not None:
        meta.update(dtype=str(block.dtype), trailing=list(trailing))
    chunks = chunk_spans((0, len(block)), chunk_elems(group, block.dtype.itemsize))
    return [
        await group.send(peer, step, c, be.payload(block, lo, hi), meta=meta if c == 0 else None)
        for c, (lo, hi) in enumerate(chunks)
    ]


def _layout(meta: dict[str, Any] | None, dtype: Any, trailing: Any) -> tuple[Any, ...]:
    fields = Fields(meta, "block header")
    rows = fields.get_int("rows", 0, _MAX_ROWS)
    if dtype is None:
        name = fields.get_str("dtype", 16)
        if name not in DTYPES:
            raise ProtocolError(f"block header names unsupported dtype {name!r}")
        dtype = DTYPES[name]
        trailing = tuple(fields.int_list("trailing", 0, _MAX_ROWS, max_len=63))
    return rows, dtype, trailing


async def recv_block(
    group: Group,
    peer: int,
    step: int,
    dtype: np.dtype[Any] | None = None,
    trailing: tuple[int, ...] | None = None,
) -> Block:
    """Receive one block from peer; dtype/trailing None means the sender describes them."""
    first = await group.recv(peer, step, 0)
    rows, dtype, trailing = _layout(first.meta, dtype, trailing)
    count = rows * math.prod(trailing)
    chunks = chunk_spans((0, count), chunk_elems(group, dtype.itemsize))
    pieces = [first.payload]
    for c in range(1, len(chunks)):
        lo, hi = chunks[c]
        pieces.append((await group.recv(peer, step, c, nbytes=(hi - lo) * dtype.itemsize)).payload)
    lo, hi = chunks[0]
    if first.payload.nbytes != (hi - lo) * dtype.itemsize:
        raise ProtocolError(
            f"rank {peer} sent {first.payload.nbytes} bytes where {rows} rows need "
            f"{(hi - lo) * dtype.itemsize}"
        )
    return Block(rows, dtype, trailing, pieces)


def assemble(be: ArrayBackend, blocks: list[Block]) -> Array:
    """Concatenate blocks (all of one dtype and trailing shape) into a new array."""
    dtype, trailing = blocks[0].dtype, blocks[0].trailing
    total_rows = sum(b.rows for b in blocks)
    out = be.empty(total_rows * math.prod(trailing), dtype)
    offset = 0
    for block in blocks:
        for piece in block.pieces:
            n = piece.nbytes // dtype.itemsize
            be.write(out, offset, offset + n, piece)
            offset += n
    return out.reshape((total_rows, *trailing))
