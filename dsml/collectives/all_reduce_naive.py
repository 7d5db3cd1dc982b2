"""Naive all-reduce: everyone sends to rank 0, which reduces and sends back (collectives).

The baseline that the ring is measured against. Cost: 2 steps, but rank 0 receives and
sends (P-1) whole arrays, so time grows linearly with P for large arrays.

Rank 0 reduces in rank order (((x0 op x1) op x2) ...) and everyone receives the same
bytes, so results are bitwise identical everywhere.

Preconditions: `src` and `out` flat, distinct, same length and dtype; `src` unchanged.
"""

from __future__ import annotations

from .arrays import Array, ArrayBackend
from .chunking import chunk_spans
from .group import Group, Receipt, chunk_elems, wait_receipts
from .ops import ReduceOp

__all__ = ["all_reduce_naive"]


async def all_reduce_naive(
    group: Group, be: ArrayBackend, src: Array, out: Array, op: ReduceOp
) -> None:
    """out = reduction over all ranks of src (see module docstring)."""
    size = group.size
    itemsize = out.dtype.itemsize
    chunks = chunk_spans((0, len(out)), chunk_elems(group, itemsize))
    receipts: list[Receipt] = []
    if group.rank != 0:
        for c, (lo, hi) in enumerate(chunks):
            receipts.append(await group.send(0, 0, c, be.payload(src, lo, hi)))
        for c, (lo, hi) in enumerate(chunks):
            msg = await group.recv(0, 1, c, nbytes=(hi - lo) * itemsize)
            be.write(out, lo, hi, msg.payload)
        await wait_receipts(receipts)
        return

    be.copy(out, 0, len(out), src)
    for peer in range(1, size):
        for c, (lo, hi) in enumerate(chunks):
            msg = await group.recv(peer, 0, c, nbytes=(hi - lo) * itemsize)
            be.reduce(op, out, lo, hi, out, msg.payload, data_first=False)
    if op is ReduceOp.AVG:
        be.scale(out, 0, len(out), size)
    for peer in range(1, size):
        for c, (lo, hi) in enumerate(chunks):
            receipts.append(await group.send(peer, 1, c, be.payload(out, lo, hi)))
    await wait_receipts(receipts)
