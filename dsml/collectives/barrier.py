"""Barrier (collectives layer).

A dissemination barrier: ceil(log2 P) rounds of empty messages; in round k rank r tells
rank r+2**k that it (and everyone it has heard from) has arrived.
"""

from __future__ import annotations

from .confirm import dissemination
from .group import Group

__all__ = ["barrier_dissemination"]


async def barrier_dissemination(group: Group) -> None:
    """Return once every rank has entered the barrier."""
    await dissemination(group)
