"""The backend's use of torch's store across groups: the end of one, the start of the next
(adapter layer).

`meet_at_close`: every rank of a closing group says in the group's store that it closed
and waits (bounded) for the others, so that all leave `destroy_process_group` together,
as Gloo's ranks do. Rank 0 leaves last, once every other rank has seen the meeting end:
under env:// it serves the store, and a rank still waiting there when rank 0's process
exited got a broken pipe (torch printed a warning with its C++ stack).

`keep_store_server`: rank 0's TCPStore server lives as long as the process. torch's
env:// (and tcp://) rendezvous has rank 0 serve the store at MASTER_PORT, one server per
process group made, closed when torch drops the group's store. The ranks leave the
meeting together, but not at the same instant: one that made its next group at once
connected, at MASTER_PORT, to rank 0's server of the old group, still open for the moment
rank 0 took to drop it, and then lost it (`DistNetworkError: Failed to recv, got 0 bytes`,
seen under load). With the server kept, MASTER_PORT names one server for the whole
process, as torchrun's agent store does for its ranks: rank 0's next TCPStore at that
port shares it (torch's rendezvous makes them multi-tenant), and a rank that connects
early reaches the server its next group uses. Keys of earlier groups stay in it, as in
torchrun's store; `rendezvous._formation` numbers each group's keys for that reason.
Under torchrun's agent store nothing is kept (rank 0 is one of its clients); a TCPStore
the caller passed (`init_process_group(store=...)`) is kept alike, on rank 0.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

__all__ = ["CLOSE_MEETING_S", "keep_store_server", "meet_at_close"]

#: `shutdown` waits at most this long for the other ranks to close too
CLOSE_MEETING_S = 5.0

# rank 0's TCPStores by port: holding one keeps its server open (see the module docstring)
_kept: dict[int, dist.TCPStore] = {}


def meet_at_close(store: dist.Store, key: str, rank: int, size: int) -> None:
    """Say in the store that this rank closed, and wait (bounded) for the others'; rank 0
    then waits (bounded) until the others have seen that too."""
    wait = timedelta(seconds=CLOSE_MEETING_S)
    try:
        store.set(f"{key}{rank}", b"1")
        store.wait([f"{key}{r}" for r in range(size)], wait)
        if rank != 0:
            store.set(f"{key}left/{rank}", b"1")  # this rank's last use of the store
        else:
            store.wait([f"{key}left/{r}" for r in range(1, size)], wait)
    except Exception:  # a rank that never closes (or a store gone) must not fail shutdown
        return


def keep_store_server(store: dist.Store) -> None:
    """Keep the TCPStore under `store` (torch wraps it in PrefixStores) until the process
    ends, so that the server rank 0 runs at its port stays open between groups."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        _kept.setdefault(store.port, store)
