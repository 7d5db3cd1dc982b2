"""Scatter parts of the root's array (collectives layer).

Cost: one hop; the root sends part j (rows split as `numpy.array_split` does) to rank j
directly. Non-roots do not know the dtype or shape in advance: the first chunk of each
part describes them. The agreement lane runs beside it (see confirm.py), so the root does
not report success for a call a peer rejected.
"""

from __future__ import annotations

from .arrays import Array, ArrayBackend
from .blocks import Block, assemble, recv_block, send_block
from .chunking import split_spans
from .confirm import confirm
from .group import Group, Receipt, wait_receipts
from .together import together

__all__ = ["scatter_direct"]


async def _deal(
    group: Group,
    be: ArrayBackend,
    flat: Array | None,
    rows: int,
    trailing: tuple[int, ...],
    root: int,
) -> Block:
    if group.rank != root:
        return await recv_block(group, root, 0)
    assert flat is not None
    row_elems = len(flat) // rows if rows else 0
    spans = split_spans(rows, group.size)
    receipts: list[Receipt] = []
    for distance in range(1, group.size):
        peer = (root + distance) % group.size
        lo, hi = spans[peer]
        part = flat[lo * row_elems : hi * row_elems]
        receipts += await send_block(group, be, peer, 0, part, hi - lo, trailing)
    await wait_receipts(receipts)
    lo, hi = spans[root]
    mine = flat[lo * row_elems : hi * row_elems]
    return Block(hi - lo, flat.dtype, trailing, [be.payload(mine, 0, len(mine))])


async def scatter_direct(
    group: Group,
    be: ArrayBackend,
    flat: Array | None,
    rows: int,
    trailing: tuple[int, ...],
    root: int,
) -> Array:
    """This rank's part of the root's array, as a new array of shape (rows_r, *trailing).

    On non-roots `flat`, `rows` and `trailing` are ignored: the root's messages say them.
    """
    block = await together(_deal(group, be, flat, rows, trailing, root), confirm(group))
    return assemble(be, [block])
