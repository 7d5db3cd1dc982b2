"""Agreement lane: a dissemination barrier that carries fingerprints (collectives layer).

In rooted collectives (broadcast, scatter, reduce, gather) a rank's result does not depend
on every other rank, so finishing would not prove that every rank called the same thing.
They therefore run this barrier beside the data, on the CONFIRM lane: every message carries
the sender's fingerprint and is checked on arrival, and a rank finishes round k only after
hearing from a rank that finished round k-1. Finishing all rounds thus means every rank's
fingerprint reached this one through a chain of checks: no rank reports success for a call
that a peer rejected. Round 0 is sent at once, so even a call in which no rank thinks it is
the root (nobody sends data) fails fast instead of hanging.

Cost: ceil(log2 P) rounds of empty messages.
"""

from __future__ import annotations

from .group import Group, Lane

__all__ = ["confirm", "dissemination"]


async def dissemination(group: Group, lane: Lane = Lane.DATA) -> None:
    """Return once every rank has entered (round k talks to rank +- 2**k)."""
    size, rank = group.size, group.rank
    distance, step = 1, 0
    while distance < size:
        await group.send((rank + distance) % size, step, lane=lane)
        await group.recv((rank - distance) % size, step, lane=lane)
        distance, step = distance * 2, step + 1


async def confirm(group: Group) -> None:
    """The agreement of rooted collectives (see module docstring)."""
    await dissemination(group, Lane.CONFIRM)
