"""Naive all-reduce: everyone sends to rank 0, which reduces and sends back (collectives).

The baseline that the ring is measured against. Cost: 2 steps, but rank 0 receives and
sends (P-1) whole arrays, so time grows linearly with P for large arrays.

Rank 0 reduces in rank order (((x0 op x1) op x2) ...) and everyone receives the same
bytes, so results are bitwise identical everywhere. `dst` is written only at the end.

Preconditions: `src`, `work` and `dst` flat, same length and dtype; `src` is only read and
may be the same memory as `dst`; `work` is scratch.
"""

from __future__ import annotations

from .arrays import Array, ArrayBackend
from .chunking import chunk_spans
from .group import Group, Receipt, chunk_elems, wait_receipts
from .ops import ReduceOp

__all__ = ["all_reduce_naive"]


async def all_reduce_naive(
    group: Group, be: ArrayBackend, src: Array, work: Array, dst: Array, op: ReduceOp
) -> list[Receipt]:
    """dst = reduction over all ranks of src; returns receipts still pending on work."""
    size = group.size
    itemsize = work.dtype.itemsize
    chunks = chunk_spans((0, len(work)), chunk_elems(group, itemsize))
    if group.rank != 0:
        receipts = [
            await group.send(0, 0, c, be.payload(src, lo, hi)) for c, (lo, hi) in enumerate(chunks)
        ]
        results = [
            (await group.recv(0, 1, c, nbytes=(hi - lo) * itemsize)).payload
            for c, (lo, hi) in enumerate(chunks)
        ]
        await wait_receipts(receipts)  # src may be dst
        for (lo, hi), payload in zip(chunks, results, strict=True):
            be.write(dst, lo, hi, payload)
        return []

    be.copy(work, 0, len(work), src)
    for peer in range(1, size):
        for c, (lo, hi) in enumerate(chunks):
            msg = await group.recv(peer, 0, c, nbytes=(hi - lo) * itemsize)
            be.reduce(op, work, lo, hi, work, msg.payload, data_first=False)
    if op is ReduceOp.AVG:
        be.scale(work, 0, len(work), size)
    pending = [
        await group.send(peer, 1, c, be.payload(work, lo, hi))
        for peer in range(1, size)
        for c, (lo, hi) in enumerate(chunks)
    ]
    if dst is not work:
        be.copy(dst, 0, len(work), work)
    return pending
