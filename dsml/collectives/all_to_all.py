"""All-to-all by direct exchange (collectives layer).

Cost: one hop; rank r sends part j of its array (rows split as `numpy.array_split` does)
to rank j and receives part r of every other rank: (P-1)/P of the array out and in.
Parts may differ in rows between ranks; dtype and trailing shape must agree.
"""

from __future__ import annotations

from .arrays import Array, ArrayBackend
from .blocks import Block, assemble, recv_block, send_block
from .chunking import split_spans
from .group import Group, Receipt, wait_receipts

__all__ = ["all_to_all_direct"]


async def all_to_all_direct(
    group: Group, be: ArrayBackend, flat: Array, rows: int, trailing: tuple[int, ...]
) -> Array:
    """The parts addressed to this rank, concatenated along axis 0 in rank order."""
    size, rank = group.size, group.rank
    row_elems = len(flat) // rows if rows else 0
    spans = split_spans(rows, size)

    def part(peer: int) -> tuple[Array, int]:
        lo, hi = spans[peer]
        return flat[lo * row_elems : hi * row_elems], hi - lo

    receipts: list[Receipt] = []
    for distance in range(1, size):
        peer = (rank + distance) % size
        receipts += await send_block(group, be, peer, 0, *part(peer))
    mine, my_rows = part(rank)
    blocks: list[Block | None] = [None] * size
    blocks[rank] = Block(my_rows, flat.dtype, trailing, [be.payload(mine, 0, len(mine))])
    for distance in range(1, size):
        peer = (rank - distance) % size
        blocks[peer] = await recv_block(group, peer, 0, flat.dtype, trailing)
    result = assemble(be, [b for b in blocks if b is not None])
    await wait_receipts(receipts)
    return result
