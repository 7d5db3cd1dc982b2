"""What the torch backend keeps in torch's store at a group's end (adapter layer).

`meet_at_close`: every rank of a closing group says in the group's store that it closed
and waits (bounded) for the others, so that all leave `destroy_process_group` together,
as Gloo's ranks do.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

__all__ = ["CLOSE_MEETING_S", "meet_at_close"]

#: `shutdown` waits at most this long for the other ranks to close too
CLOSE_MEETING_S = 5.0


def meet_at_close(store: dist.Store, key: str, rank: int, size: int) -> None:
    """Say in the store that this rank closed, and wait (bounded) for the others'."""
    try:
        store.set(f"{key}{rank}", b"1")
        wait = timedelta(seconds=CLOSE_MEETING_S)
        store.wait([f"{key}{r}" for r in range(size)], wait)
    except Exception:  # a rank that never closes (or a store gone) must not fail shutdown
        return
