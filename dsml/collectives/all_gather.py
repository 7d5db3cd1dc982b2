"""All-gather by direct exchange (collectives layer).

Cost: one hop of latency; each rank sends its block to every other rank and receives
theirs: (P-1) blocks out and in per rank, the same bytes as a ring but without the P-1
forwarding steps. Sends go to r+1, r+2, ... and receives come from r-1, r-2, ..., so no
rank is everyone's first target. Blocks may differ in their number of rows.

Every rank's result depends on a checked message from every other rank, so success means
every rank agreed.
"""

from __future__ import annotations

from .arrays import Array, ArrayBackend
from .blocks import Block, assemble, recv_block, send_block
from .group import Group, Receipt, wait_receipts

__all__ = ["all_gather_direct"]


async def all_gather_direct(
    group: Group, be: ArrayBackend, block: Array, rows: int, trailing: tuple[int, ...]
) -> Array:
    """Every rank's block concatenated along axis 0 in rank order."""
    size, rank = group.size, group.rank
    receipts: list[Receipt] = []
    for distance in range(1, size):
        receipts += await send_block(group, be, (rank + distance) % size, 0, block, rows)
    blocks: list[Block | None] = [None] * size
    blocks[rank] = Block(rows, block.dtype, trailing, [be.payload(block, 0, len(block))])
    for distance in range(1, size):
        peer = (rank - distance) % size
        blocks[peer] = await recv_block(group, peer, 0, block.dtype, trailing)
    result = assemble(be, [b for b in blocks if b is not None])
    await wait_receipts(receipts)
    return result
