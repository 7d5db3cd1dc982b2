"""Direct all-reduce: every rank sends its array to every other rank (collectives layer).

Cost: one hop of latency, whatever P; each rank sends and receives (P-1) whole arrays and
reduces them locally. On loopback, where a hop costs far more than a few KiB of bandwidth,
this is the fastest way to reduce small arrays. Each rank folds the P arrays in rank order
(((x0 op x1) op x2) ...), so every rank computes the same bytes.

Preconditions: `src`, `work` and `dst` flat, same length and dtype; `src` is only read and
may be the same memory as `dst`; `work` is scratch.
"""

from __future__ import annotations

from .arrays import Array, ArrayBackend
from .chunking import chunk_spans
from .group import Group, Receipt, chunk_elems, wait_receipts
from .ops import ReduceOp

__all__ = ["all_reduce_direct"]


async def all_reduce_direct(
    group: Group, be: ArrayBackend, src: Array, work: Array, dst: Array, op: ReduceOp
) -> list[Receipt]:
    """dst = reduction over all ranks of src; returns receipts still pending on work."""
    size, rank = group.size, group.rank
    itemsize = work.dtype.itemsize
    chunks = chunk_spans((0, len(work)), chunk_elems(group, itemsize))
    receipts = [
        await group.send((rank + d) % size, 0, c, be.payload(src, lo, hi))
        for d in range(1, size)
        for c, (lo, hi) in enumerate(chunks)
    ]
    arrays: list[list[memoryview] | None] = [None] * size
    for d in range(1, size):
        peer = (rank - d) % size
        arrays[peer] = [
            (await group.recv(peer, 0, c, nbytes=(hi - lo) * itemsize)).payload
            for c, (lo, hi) in enumerate(chunks)
        ]
    for c, (lo, hi) in enumerate(chunks):
        first = be.payload(src, lo, hi) if rank == 0 else arrays[0][c]  # type: ignore[index]
        be.write(work, lo, hi, first)
        for peer in range(1, size):
            data = be.payload(src, lo, hi) if peer == rank else arrays[peer][c]  # type: ignore[index]
            be.reduce(op, work, lo, hi, work, data, data_first=False)
    if op is ReduceOp.AVG:
        be.scale(work, 0, len(work), size)
    await wait_receipts(receipts)  # src may be dst
    if dst is not work:
        be.copy(dst, 0, len(work), work)
    return []
