"""Gather blocks of rows to a root (collectives layer).

Cost: one hop; the root receives every other rank's block directly (P-1 messages, chunked),
which is latency-optimal and moves each byte once. Blocks may differ in their number of
rows. The agreement lane runs beside it (see confirm.py).
"""

from __future__ import annotations

from .arrays import Array, ArrayBackend
from .blocks import Block, assemble, recv_block, send_block
from .confirm import confirm
from .group import Group, wait_receipts
from .together import together

__all__ = ["gather_direct"]


async def _collect(
    group: Group, be: ArrayBackend, block: Array, rows: int, trailing: tuple[int, ...], root: int
) -> Array | None:
    if group.rank != root:
        await wait_receipts(await send_block(group, be, root, 0, block, rows))
        return None
    blocks = []
    for peer in range(group.size):
        if peer == root:
            mine = Block(rows, block.dtype, trailing, [be.payload(block, 0, len(block))])
            blocks.append(mine)
        else:
            blocks.append(await recv_block(group, peer, 0, block.dtype, trailing))
    return assemble(be, blocks)


async def gather_direct(
    group: Group, be: ArrayBackend, block: Array, rows: int, trailing: tuple[int, ...], root: int
) -> Array | None:
    """On the root: every rank's block concatenated in rank order; elsewhere None."""
    return await together(_collect(group, be, block, rows, trailing, root), confirm(group))
