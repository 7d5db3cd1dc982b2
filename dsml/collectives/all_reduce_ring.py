"""Ring all-reduce: reduce-scatter, then all-gather around the ring (collectives layer).

Cost: 2(P-1) steps; each rank sends and receives 2(P-1)/P of the array (bandwidth-optimal)
and reduces (P-1)/P of it. Segments are cut into chunks that stream: a chunk of the rank's
own segment leaves for the all-gather the moment its reduction is final, and all-gather
chunks are passed on as the frames they arrived in, without a copy.

Every segment is reduced exactly once, by one rank, in ring order, and then copied around,
so every rank ends with bitwise-identical results.

Nothing is written to `dst` until every message has arrived: the received all-gather
frames are kept and copied into `dst` at the end, together with the rank's own segment.
So a failure leaves `dst` (the caller's array) untouched, and no extra full copy is made.
Partial sums travel in buffers of their own (see reduce_scatter.py): of `work`, only the
own segment is written. Peak memory: the array, (P-1)/P of it in kept frames, 1/P in
`work`, and the chunks in flight.

Preconditions: `src`, `work` and `dst` flat, same length and dtype; `src` is only read and
may be the same memory as `dst`; `work` is scratch.
"""

from __future__ import annotations

from .arrays import Array, ArrayBackend
from .chunking import chunk_spans, split_spans
from .group import Group, Receipt, chunk_elems, wait_receipts
from .ops import ReduceOp
from .reduce_scatter import reduce_scatter_ring

__all__ = ["all_reduce_ring"]


async def all_reduce_ring(
    group: Group, be: ArrayBackend, src: Array, work: Array, dst: Array, op: ReduceOp
) -> list[Receipt]:
    """dst = reduction over all ranks of src; returns receipts still pending on work."""
    size, rank = group.size, group.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    itemsize = work.dtype.itemsize
    spans = split_spans(len(work), size)
    chunks = [chunk_spans(span, chunk_elems(group, itemsize)) for span in spans]
    gather_step = size - 1  # all-gather steps are numbered after the P-1 reduce steps
    pending: list[Receipt] = []

    async def on_final(c: int, lo: int, hi: int) -> None:
        if op is ReduceOp.AVG:
            be.scale(work, lo, hi, size)
        pending.append(await group.send(right, gather_step, c, be.payload(work, lo, hi)))

    # Phase 1: reduce-scatter; rank r ends owning segment r, already streaming onwards.
    from_src = await reduce_scatter_ring(group, be, src, work, op, spans, on_final)

    # Phase 2: all-gather; at step k segment r-k-1 arrives; pass it on (but the last).
    arrived: list[tuple[int, int, memoryview]] = []
    for k in range(size - 1):
        seg = (rank - k - 1) % size
        for c, (lo, hi) in enumerate(chunks[seg]):
            msg = await group.recv(left, gather_step + k, c, nbytes=(hi - lo) * itemsize)
            arrived.append((lo, hi, msg.payload))
            if k < size - 2:
                await group.send(right, gather_step + k + 1, c, msg.payload)

    # Every message is in: only now write the result.
    await wait_receipts(from_src)  # src may be dst
    if dst is not work:
        lo, hi = spans[rank]
        be.copy(dst, lo, hi, work)
    for lo, hi, payload in arrived:
        be.write(dst, lo, hi, payload)
    return pending
