"""Binomial trees rooted anywhere (collectives layer).

Ranks are renumbered relative to the root (vrank = (rank - root) mod P). The parent of a
vrank clears its lowest set bit; its children add the powers of two below that bit. The
root reaches everyone in ceil(log2 P) hops.
"""

from __future__ import annotations

__all__ = ["binomial_tree"]


def binomial_tree(rank: int, size: int, root: int) -> tuple[int | None, list[int]]:
    """(parent, children) of rank; children listed largest subtree first."""
    vrank = (rank - root) % size
    lowbit = vrank & -vrank if vrank else 1 << size.bit_length()
    parent = None if vrank == 0 else (vrank - lowbit + root) % size
    children = []
    mask = lowbit >> 1
    while mask:
        if vrank + mask < size:
            children.append((vrank + mask + root) % size)
        mask >>= 1
    return parent, children
