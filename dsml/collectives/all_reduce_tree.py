"""Recursive-doubling all-reduce, latency-optimal for small arrays (collectives layer).

Cost: ceil(log2 P) steps for a power of two, plus 2 for the others; each step exchanges
the whole array with one partner. Good when latency dominates (a few KiB), wasteful in
bandwidth for large arrays (use the ring there).

Non-powers of two: with p2 the largest power of two <= P and rem = P - p2, ranks below
2*rem pair up first (even sends to odd, which folds it in), the p2 survivors double, and
the odd ranks hand the result back to their even partners.

Both partners of a step compute op(lower ranks' partial, higher ranks' partial), in that
order, so every rank ends with bitwise-identical results.

The result is computed in `work` and copied to `dst` only at the end.

Preconditions: `src`, `work` and `dst` flat, same length and dtype; `src` is only read and
may be the same memory as `dst`; `work` is scratch.
"""

from __future__ import annotations

from .arrays import Array, ArrayBackend
from .chunking import Span, chunk_spans
from .group import Group, Receipt, chunk_elems, wait_receipts
from .ops import ReduceOp

__all__ = ["all_reduce_tree"]


async def _exchange(
    group: Group,
    be: ArrayBackend,
    out: Array,
    op: ReduceOp,
    partner: int,
    step: int,
    chunks: list[Span],
) -> None:
    """Swap out with partner; out = op(lower rank's data, higher rank's data)."""
    itemsize = out.dtype.itemsize
    receipts = [
        await group.send(partner, step, c, be.payload(out, lo, hi))
        for c, (lo, hi) in enumerate(chunks)
    ]
    for c, (lo, hi) in enumerate(chunks):
        msg = await group.recv(partner, step, c, nbytes=(hi - lo) * itemsize)
        await receipts[c].wait()  # out[lo:hi] may still be on its way to the partner
        be.reduce(op, out, lo, hi, out, msg.payload, data_first=partner < group.rank)


async def _send_all(
    group: Group, be: ArrayBackend, out: Array, peer: int, step: int, chunks: list[Span]
) -> None:
    receipts = [
        await group.send(peer, step, c, be.payload(out, lo, hi))
        for c, (lo, hi) in enumerate(chunks)
    ]
    await wait_receipts(receipts)


async def _recv_all(
    group: Group,
    be: ArrayBackend,
    out: Array,
    peer: int,
    step: int,
    chunks: list[Span],
    op: ReduceOp | None,
) -> None:
    """Receive from peer into out: written as is (op None) or folded in after it."""
    itemsize = out.dtype.itemsize
    for c, (lo, hi) in enumerate(chunks):
        msg = await group.recv(peer, step, c, nbytes=(hi - lo) * itemsize)
        if op is None:
            be.write(out, lo, hi, msg.payload)
        else:
            be.reduce(op, out, lo, hi, out, msg.payload, data_first=True)


async def all_reduce_tree(
    group: Group, be: ArrayBackend, src: Array, work: Array, dst: Array, op: ReduceOp
) -> list[Receipt]:
    """dst = reduction over all ranks of src; returns receipts still pending on work."""
    await _recursive_doubling(group, be, src, work, op)
    if dst is not work:
        be.copy(dst, 0, len(work), work)
    return []


async def _recursive_doubling(
    group: Group, be: ArrayBackend, src: Array, out: Array, op: ReduceOp
) -> None:
    size, rank = group.size, group.rank
    chunks = chunk_spans((0, len(out)), chunk_elems(group, out.dtype.itemsize))
    be.copy(out, 0, len(out), src)
    p2 = 1 << (size.bit_length() - 1)
    rem = size - p2
    rounds = p2.bit_length() - 1
    last_step = rounds + 1

    # Fold-in: even ranks below 2*rem give their data to the odd rank above them.
    if rank < 2 * rem and rank % 2 == 0:
        await _send_all(group, be, out, rank + 1, 0, chunks)
        await _recv_all(group, be, out, rank + 1, last_step, chunks, None)
        return  # what came back is final (already scaled for avg)
    if rank < 2 * rem:
        await _recv_all(group, be, out, rank - 1, 0, chunks, op)
    vrank = rank // 2 if rank < 2 * rem else rank - rem

    # Recursive doubling among the p2 survivors.
    for step in range(1, rounds + 1):
        vpartner = vrank ^ (1 << (step - 1))
        partner = vpartner * 2 + 1 if vpartner < rem else vpartner + rem
        await _exchange(group, be, out, op, partner, step, chunks)

    if op is ReduceOp.AVG:
        be.scale(out, 0, len(out), size)
    # Hand-back: the odd rank returns the result to its even partner.
    if rank < 2 * rem:
        await _send_all(group, be, out, rank - 1, last_step, chunks)
