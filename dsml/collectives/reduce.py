"""Reduce to a root along a binomial tree, chunk-pipelined (collectives layer).

Cost: ceil(log2 P) hops of latency; each rank receives from at most log2 P children and
sends once to its parent, chunk by chunk: chunk c leaves as soon as every child's chunk c
is folded in. The agreement lane runs beside it (see confirm.py), so non-roots do not
report success for a call the root rejected.

Preconditions: `src` and `out` flat, distinct, same length and dtype; `src` unchanged;
only the root's `out` is meaningful afterwards.
"""

from __future__ import annotations

from .arrays import Array, ArrayBackend
from .binomial import binomial_tree
from .chunking import chunk_spans
from .confirm import confirm
from .group import Group, Receipt, chunk_elems, wait_receipts
from .ops import ReduceOp
from .together import together

__all__ = ["reduce_tree"]


async def _fold(
    group: Group, be: ArrayBackend, src: Array, out: Array, op: ReduceOp, root: int
) -> None:
    parent, children = binomial_tree(group.rank, group.size, root)
    itemsize = out.dtype.itemsize
    be.copy(out, 0, len(out), src)
    receipts: list[Receipt] = []
    for c, (lo, hi) in enumerate(chunk_spans((0, len(out)), chunk_elems(group, itemsize))):
        for child in reversed(children):  # smallest subtree first: it is ready first
            msg = await group.recv(child, 0, c, nbytes=(hi - lo) * itemsize)
            be.reduce(op, out, lo, hi, out, msg.payload, data_first=False)
        if parent is not None:
            receipts.append(await group.send(parent, 0, c, be.payload(out, lo, hi)))
        elif op is ReduceOp.AVG:
            be.scale(out, lo, hi, group.size)
    await wait_receipts(receipts)


async def reduce_tree(
    group: Group, be: ArrayBackend, src: Array, out: Array, op: ReduceOp, root: int
) -> None:
    """The root's out = reduction over all ranks of src."""
    await together(_fold(group, be, src, out, op, root), confirm(group))
