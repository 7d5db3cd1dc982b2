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
Partial sums, the own segment's final sums included, are written over the frames they
arrived in (`ArrayBackend.combine`) and sent on as those frames: no buffer is allocated
and nothing needs tracking. Only where a received frame cannot hold a result (a device
backend, whose results stay on the device) does the own segment go through `work`. Peak
memory: the array, (P-1)/P of it in kept frames (all of it with the own segment), and the
chunks in flight.

Preconditions: `src`, `work` and `dst` flat, same length and dtype; `src` is only read and
may be the same memory as `dst`; `work` is scratch.
"""

from __future__ import annotations

from .arrays import Array, ArrayBackend
from .chunking import Span, chunk_spans, split_spans
from .group import Group, Receipt, chunk_elems, wait_receipts
from .ops import ReduceOp

__all__ = ["all_reduce_ring"]

#: (lo, hi, bytes) of a part of the result, written into `dst` once every message is in
Part = tuple[int, int, memoryview]


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
    arrived: list[Part] = []
    in_work: list[Span] = []  # own-segment chunks reduced in `work` (no writable frame)

    # Phase 1: reduce-scatter; rank r ends owning segment r, already streaming onwards.
    from_src = [
        await group.send(right, 0, c, be.payload(src, lo, hi))
        for c, (lo, hi) in enumerate(chunks[left])
    ]
    for k in range(size - 1):
        seg = (rank - k - 2) % size
        last = k == size - 2  # this step completes segment `rank`
        step = gather_step if last else k + 1
        for c, (lo, hi) in enumerate(chunks[seg]):
            data = (await group.recv(left, k, c, nbytes=(hi - lo) * itemsize)).payload
            if last and be.writable(data, work.dtype) is None:
                result = _reduce_in_work(be, op, src, work, lo, hi, data, size)
                in_work.append((lo, hi))
            else:
                result = _reduce_in_frame(be, op, src, lo, hi, data, size if last else 0)
                if last:
                    arrived.append((lo, hi, result))
            pending.append(await group.send(right, step, c, result))

    # Phase 2: all-gather; at step k segment r-k-1 arrives; pass it on (but the last).
    for k in range(size - 1):
        seg = (rank - k - 1) % size
        for c, (lo, hi) in enumerate(chunks[seg]):
            msg = await group.recv(left, gather_step + k, c, nbytes=(hi - lo) * itemsize)
            arrived.append((lo, hi, msg.payload))
            if k < size - 2:
                await group.send(right, gather_step + k + 1, c, msg.payload)

    # Every message is in: only now write the result.
    await wait_receipts(from_src)  # src may be dst
    for lo, hi in in_work if dst is not work else ():
        be.copy(dst, lo, hi, work)
    for lo, hi, payload in arrived:
        be.write(dst, lo, hi, payload)
    return pending


def _reduce_in_frame(
    be: ArrayBackend,
    op: ReduceOp,
    src: Array,
    lo: int,
    hi: int,
    data: memoryview,
    avg_of: int,
) -> memoryview:
    """data op src[lo:hi], over the received frame where it is writable; divided by
    `avg_of` for op='avg' when nonzero (the final sums). Returns the result's bytes."""
    partial = be.combine(op, src, lo, hi, data)
    if avg_of and op is ReduceOp.AVG:
        be.scale(partial, 0, hi - lo, avg_of)
    return be.payload(partial, 0, hi - lo)


def _reduce_in_work(
    be: ArrayBackend,
    op: ReduceOp,
    src: Array,
    work: Array,
    lo: int,
    hi: int,
    data: memoryview,
    size: int,
) -> memoryview:
    """work[lo:hi] = data op src[lo:hi] (/ size for op='avg'); returns its bytes."""
    be.reduce(op, work, lo, hi, src, data, data_first=True)
    if op is ReduceOp.AVG:
        be.scale(work, lo, hi, size)
    return be.payload(work, lo, hi)
