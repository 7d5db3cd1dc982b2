"""Broadcast along a binomial tree, chunk-pipelined (collectives layer).

Cost: ceil(log2 P) hops of latency; each rank receives the array once and forwards it to
at most log2 P children, chunk by chunk, so a large array streams down the tree. Received
frames are forwarded as they are, without a copy. The agreement lane runs beside it (see
confirm.py), so the root too learns of a rank that rejected the call.

Preconditions: `buf` flat; on the root it holds the data (read only), elsewhere it
receives the data.
"""

from __future__ import annotations

from .arrays import Array, ArrayBackend
from .binomial import binomial_tree
from .chunking import chunk_spans
from .confirm import confirm
from .group import Group, Receipt, chunk_elems, wait_receipts
from .together import together

__all__ = ["broadcast_tree"]


async def _stream(group: Group, be: ArrayBackend, buf: Array, root: int) -> None:
    parent, children = binomial_tree(group.rank, group.size, root)
    itemsize = buf.dtype.itemsize
    receipts: list[Receipt] = []
    for c, (lo, hi) in enumerate(chunk_spans((0, len(buf)), chunk_elems(group, itemsize))):
        if parent is None:
            data = be.payload(buf, lo, hi)
        else:
            data = (await group.recv(parent, 0, c, nbytes=(hi - lo) * itemsize)).payload
            be.write(buf, lo, hi, data)
        for child in children:
            receipts.append(await group.send(child, 0, c, data))
    await wait_receipts(receipts)


async def broadcast_tree(group: Group, be: ArrayBackend, buf: Array, root: int) -> None:
    """Copy the root's buf into every rank's buf."""
    await together(_stream(group, be, buf, root), confirm(group))
