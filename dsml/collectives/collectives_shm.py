"""Broadcast, all-gather and reduce-scatter through shared memory on one host (collectives).

Each follows the ordering rules of shm_group.py; each returns None (False for broadcast),
having written nothing, when some rank had no room in /dev/shm, so the caller can run
its TCP algorithm instead. Costs, P ranks and n bytes:

* `broadcast_shm`: the root writes its array into its inline area (small) or, piece by
  piece, its staging area; the others copy it out. n written once, read P-1 times; one
  sync when small, two per piece otherwise (pieces of `stage_bytes`, larger past
  MAX_PIECES / 2 of them).
* `all_gather_shm`: every rank writes its row count and block (inline when it fits, else
  staging), sync, every rank copies every block into the result, sync. Blocks may differ
  in rows; each must fit one staging area.
* `reduce_scatter_shm`: the reduce-scatter half of all_reduce_shm (rank r reduces slice
  r straight from the peers' areas); small arrays reduce from the inline areas after a
  single sync.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .all_reduce_shm import MAX_PIECES, reduce_into, reduce_slices, results
from .arrays import Array
from .ops import ReduceOp
from .shm_group import ShmGroup, staging

__all__ = ["all_gather_shm", "broadcast_shm", "reduce_scatter_shm"]

_HEADER = 16  # all_gather: int64 rows, int64 where (0 inline, 1 staging)


async def broadcast_shm(group: ShmGroup, buf: Array, root: int, stage_bytes: int) -> bool:
    """Copy the root's buf into every rank's buf (flat, contiguous)."""
    data = buf.view(np.uint8)
    nbytes, is_root = len(data), group.rank == root
    if nbytes <= group.inline_bytes:
        if is_root:
            group.inline(root)[:nbytes] = data
        await group.sync()
        if not is_root:
            data[:] = group.inline(root)[:nbytes]
        return True
    # Two syncs per piece: past MAX_PIECES / 2 pieces of the budget, pieces grow so the
    # call's phases fit the link's progress word (see all_reduce_shm.MAX_PIECES).
    piece = max(buf.dtype.itemsize, min(nbytes, stage_bytes), -(-nbytes // (MAX_PIECES // 2)))
    room = group.reserve(0, piece) if is_root else True
    for lo in range(0, nbytes, piece):
        hi = min(lo + piece, nbytes)
        if is_root and room:
            staging(group.area(root), piece)[: hi - lo] = data[lo:hi]
        if not await group.sync(room) and lo == 0:
            return False
        if not is_root:
            data[lo:hi] = staging(group.area(root), piece)[: hi - lo]
        await group.sync()  # the root's staging area may be written again
    return True


async def all_gather_shm(
    group: ShmGroup, block: Array, rows: int, trailing: tuple[int, ...]
) -> Array | None:
    """Every rank's block (flat, `rows` rows of shape `trailing`) concatenated along axis
    0 in rank order; None when some rank had no room."""
    raw = block.view(np.uint8)
    head = group.inline(group.rank)[:_HEADER].view(np.int64)
    inline = len(raw) + _HEADER <= group.inline_bytes
    room = inline or group.reserve(0, len(raw))
    if inline:
        group.inline(group.rank)[_HEADER : _HEADER + len(raw)] = raw
    elif room:
        staging(group.area(group.rank), len(raw))[:] = raw
    head[0], head[1] = rows, 0 if inline else 1
    if not await group.sync(room):
        return None
    counts = [int(group.inline(j)[:_HEADER].view(np.int64)[0]) for j in range(group.size)]
    per_row = int(np.prod(trailing, dtype=np.int64)) * block.dtype.itemsize
    result = np.empty((sum(counts), *trailing), dtype=block.dtype)
    out, at = result.reshape(-1).view(np.uint8), 0
    for j, count in enumerate(counts):
        size = count * per_row
        out[at : at + size] = _block_bytes(group, j, size)
        at += size
    await group.sync()  # staging areas may be written again
    return result


def _block_bytes(group: ShmGroup, rank: int, size: int) -> Any:
    where = int(group.inline(rank)[:_HEADER].view(np.int64)[1])
    if where == 0:
        return group.inline(rank)[_HEADER : _HEADER + size]
    return staging(group.area(rank), size)


async def reduce_scatter_shm(
    group: ShmGroup, src: Array, spans: list[tuple[int, int]], op: ReduceOp, stage_bytes: int
) -> Array | None:
    """The reduction of span `rank` of every rank's src (a new flat array); None when
    some rank had no room."""
    lo, hi = spans[group.rank]
    if src.nbytes <= group.inline_bytes:
        group.inline(group.rank)[: src.nbytes] = src.view(np.uint8)
        await group.sync()
        inputs = [group.inline(j)[: src.nbytes].view(src.dtype) for j in range(group.size)]
        out = np.empty(hi - lo, dtype=src.dtype)
        reduce_into(out, inputs, op, lo, hi)
        if op is ReduceOp.AVG:
            np.divide(out, group.size, out=out, casting="unsafe")
        return out
    if not await reduce_slices(group, src, spans, op, stage_bytes):
        return None
    return results(group, group.rank, src.dtype, hi - lo).copy()
