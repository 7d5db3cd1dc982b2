"""Ring reduce-scatter (collectives layer).

Rank r ends with the reduction of `spans[r]` in `out[spans[r]]`.

Cost: P-1 steps; each rank sends and receives (P-1)/P of the array and reduces as much.
At step k rank r sends segment (r-k-1) to its right neighbour and reduces segment (r-k-2)
arriving from its left, chunk by chunk, so the next step's chunk leaves as soon as it is
reduced: sending, receiving and adding overlap. Step 0 sends straight from `src`; later
steps send the partial sums in `out`.

Preconditions: `src` and `out` are flat, distinct, of the same length and dtype; `src` is
not modified; `spans` has one span per rank and is the same on every rank.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from .arrays import Array, ArrayBackend
from .chunking import Span, chunk_spans
from .group import Group, Receipt, chunk_elems
from .ops import ReduceOp

__all__ = ["reduce_scatter_ring"]

#: Called with (chunk index, lo, hi) when a chunk of the rank's own segment is final.
OnFinal = Callable[[int, int, int], Awaitable[None]]


async def reduce_scatter_ring(
    group: Group,
    be: ArrayBackend,
    src: Array,
    out: Array,
    op: ReduceOp,
    spans: list[Span],
    on_final: OnFinal | None = None,
) -> list[Receipt]:
    """Run the reduce-scatter; returns the receipts of the sends made from `src`."""
    size, rank = group.size, group.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    itemsize = out.dtype.itemsize
    chunks = [chunk_spans(span, chunk_elems(group, itemsize)) for span in spans]

    # Step 0: our own contribution to segment r-1 leaves directly from the input.
    from_src = [
        await group.send(right, 0, c, be.payload(src, lo, hi))
        for c, (lo, hi) in enumerate(chunks[(rank - 1) % size])
    ]

    for k in range(size - 1):
        seg = (rank - k - 2) % size
        for c, (lo, hi) in enumerate(chunks[seg]):
            msg = await group.recv(left, k, c, nbytes=(hi - lo) * itemsize)
            if k == size - 2:  # segment `rank` is complete for this chunk
                be.reduce(op, out, lo, hi, src, msg.payload, data_first=True)
                if on_final is not None:
                    await on_final(c, lo, hi)
            else:
                partial = be.combine(op, src, lo, hi, msg.payload)
                await group.send(right, k + 1, c, be.payload(partial, 0, hi - lo))
    return from_src
