"""Ring all-reduce: reduce-scatter, then all-gather around the ring (collectives layer).

Cost: 2(P-1) steps; each rank sends and receives 2(P-1)/P of the array (bandwidth-optimal)
and reduces (P-1)/P of it. Segments are cut into chunks that stream: a chunk of the rank's
own segment leaves for the all-gather the moment its reduction is final.

Every segment is reduced exactly once, by one rank, in ring order, and then copied around,
so every rank ends with bitwise-identical results.

Preconditions: `src` and `out` flat, distinct, same length and dtype; `src` unchanged.
"""

from __future__ import annotations

from .arrays import Array, ArrayBackend
from .chunking import chunk_spans, split_spans
from .group import Group, Receipt, chunk_elems, wait_receipts
from .ops import ReduceOp
from .reduce_scatter import reduce_scatter_ring

__all__ = ["all_reduce_ring"]


async def all_reduce_ring(
    group: Group, be: ArrayBackend, src: Array, out: Array, op: ReduceOp
) -> None:
    """out = reduction over all ranks of src (see module docstring)."""
    size, rank = group.size, group.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    itemsize = out.dtype.itemsize
    spans = split_spans(len(out), size)
    chunks = [chunk_spans(span, chunk_elems(group, itemsize)) for span in spans]
    gather_step = size - 1  # all-gather steps are numbered after the P-1 reduce steps
    forwarded: list[Receipt] = []

    async def on_final(c: int, lo: int, hi: int) -> None:
        if op is ReduceOp.AVG:
            be.scale(out, lo, hi, size)
        forwarded.append(await group.send(right, gather_step, c, be.payload(out, lo, hi)))

    # Phase 1: reduce-scatter; rank r ends owning segment r, already streaming onwards.
    sent = await reduce_scatter_ring(group, be, src, out, op, spans, on_final)

    # Phase 2: all-gather; at step k receive segment r-k-1 and pass it on (but the last).
    for k in range(size - 1):
        seg = (rank - k - 1) % size
        await wait_receipts(sent.pop(seg, ()))  # out[seg] may still be on its way out
        for c, (lo, hi) in enumerate(chunks[seg]):
            msg = await group.recv(left, gather_step + k, c, nbytes=(hi - lo) * itemsize)
            be.write(out, lo, hi, msg.payload)
            if k < size - 2:
                forwarded.append(await group.send(right, gather_step + k + 1, c, msg.payload))

    for receipts in sent.values():
        await wait_receipts(receipts)
    await wait_receipts(forwarded)
