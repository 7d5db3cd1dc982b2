"""Full-mesh all-reduce: reduce-scatter and all-gather by direct exchange (collectives).

Like the ring, rank r reduces segment r of the array and then hands it to everyone; unlike
the ring, every segment goes straight to its owner and every result straight to every
rank, so the whole call takes two hops whatever P is. Each rank sends and receives
2(P-1)/P of the array (the ring's volume) and reduces (P-1)/P of it, and no rank does
more than its share (unlike `naive`).

Where a hop is expensive compared with moving a few megabytes (loopback, where each
message wakes ZeroMQ's I/O threads on both sides), two hops beat the ring's 2(P-1) up to
large arrays. Segments are chunked; chunk c of the own segment is reduced, in rank order,
as soon as every peer's chunk c is in, and leaves at once.

Each segment is reduced by one rank in rank order and copied to the others, so every rank
holds the same bytes. The reduction is written over a frame received for it (no copy into
`work`, and the result leaves as that frame, with nothing to track) where frames are
writable host memory; otherwise in `work`. `dst` is written only once every message has
arrived.

Preconditions: `src`, `work` and `dst` flat, same length and dtype; `src` is only read and
may be the same memory as `dst`; `work` is scratch.
"""

from __future__ import annotations

from typing import Any

from .arrays import Array, ArrayBackend
from .chunking import chunk_spans, split_spans
from .group import Group, Receipt, chunk_elems, wait_receipts
from .ops import ReduceOp

__all__ = ["all_reduce_mesh"]


async def all_reduce_mesh(
    group: Group, be: ArrayBackend, src: Array, work: Array, dst: Array, op: ReduceOp
) -> list[Receipt]:
    """dst = reduction over all ranks of src; returns receipts still pending on work."""
    size, rank = group.size, group.rank
    itemsize = work.dtype.itemsize
    spans = split_spans(len(work), size)
    chunks = [chunk_spans(span, chunk_elems(group, itemsize)) for span in spans]
    peers = [(rank + d) % size for d in range(1, size)]
    from_src: list[Receipt] = []
    pending: list[Receipt] = []

    # Phase 1: segment j of our input goes straight to rank j.
    for peer in peers:
        for c, (lo, hi) in enumerate(chunks[peer]):
            from_src.append(await group.send(peer, 0, c, be.payload(src, lo, hi)))

    # Reduce our segment chunk by chunk, in rank order; each result leaves at once.
    arrived: list[tuple[int, int, memoryview]] = []
    in_work: list[tuple[int, int]] = []  # chunks of the result reduced in `work`
    for c, (lo, hi) in enumerate(chunks[rank]):
        parts = {
            q: (await group.recv(q, 0, c, nbytes=(hi - lo) * itemsize)).payload
            for q in reversed(peers)
        }
        parts[rank] = be.payload(src, lo, hi)
        result = _reduce_in_frame(be, op, parts, rank, work.dtype)
        if result is None:  # no frame to write into: reduce in `work`
            be.write(work, lo, hi, parts[0])
            for q in range(1, size):
                be.reduce(op, work, lo, hi, work, parts[q], data_first=False)
            if op is ReduceOp.AVG:
                be.scale(work, lo, hi, size)
            result = be.payload(work, lo, hi)
            in_work.append((lo, hi))
        else:
            arrived.append((lo, hi, result))
        for peer in peers:
            pending.append(await group.send(peer, 1, c, result))

    # Phase 2: every other segment arrives from its owner; keep the frames.
    for peer in reversed(peers):
        for c, (lo, hi) in enumerate(chunks[peer]):
            msg = await group.recv(peer, 1, c, nbytes=(hi - lo) * itemsize)
            arrived.append((lo, hi, msg.payload))

    # Every message is in: only now write the result.
    await wait_receipts(from_src)  # src may be dst
    for lo, hi in in_work if dst is not work else ():
        be.copy(dst, lo, hi, work)
    for lo, hi, payload in arrived:
        be.write(dst, lo, hi, payload)
    return pending


def _reduce_in_frame(
    be: ArrayBackend, op: ReduceOp, parts: dict[int, memoryview], rank: int, dtype: Any
) -> memoryview | None:
    """Reduce parts[0] op parts[1] op ... (rank order) into a received frame; returns its
    bytes (sent on as that frame: no copy, nothing to track), or None where no received
    frame can hold the result. parts[rank] is this rank's input: only ever read."""
    if len(parts) < 2:
        return None
    holder = 1 if rank == 0 else 0  # the lowest-ranked peer's frame holds the result
    acc = be.writable(parts[holder], dtype)
    if acc is None:
        return None
    n = len(acc)
    if holder == 1:  # parts[0] is our own input: acc = parts[0] op acc, in rank order
        be.reduce(op, acc, 0, n, acc, parts[0], data_first=True)
    for q in range(holder + 1, len(parts)):
        be.reduce(op, acc, 0, n, acc, parts[q], data_first=False)
    if op is ReduceOp.AVG:
        be.scale(acc, 0, n, len(parts))
    return parts[holder]
