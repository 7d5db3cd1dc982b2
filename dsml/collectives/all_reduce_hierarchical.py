"""Hierarchical all-reduce: shared memory inside each host, a ring between hosts (collectives).

H hosts with L ranks each (every host the same L). Local rank i of every host carries
slice i of the array between hosts, so each host has L links busy at once:

1. Inside each host, a shared-memory reduce-scatter: local rank i reduces slice i of
   its host's inputs into its results area (all_reduce_shm.reduce_slices).
2. Between hosts, local rank i of every host runs a ring all-reduce over TCP on its
   slice (the `ring` group: H members, one per host), in place in its results area.
3. Sync inside the host, then every rank copies all L finished slices into `dst`.

Cost per rank: the shared-memory phases of all_reduce_shm on n bytes, plus a ring over H
ranks on n/L bytes: 2(H-1)/H x n/L bytes sent per rank, 2(H-1) steps. For op "avg" the
phases sum and the slice's owner divides by H x L at the end.

Preconditions: `src` and `dst` flat numpy arrays (`dst` may be `src`); `local` is this
rank's host (an ShmGroup of L ranks), `ring` the Group of this local rank's peers on
the other hosts (ranks 0..H-1 in host order). Returns False, having written nothing,
when some rank of this host had no room in /dev/shm (the caller then runs a TCP
algorithm; every host decides alike only when all lack room, so callers size
`shm_max_bytes` for the largest array).
"""

from __future__ import annotations

import numpy as np

from .all_reduce_ring import all_reduce_ring
from .all_reduce_shm import reduce_slices, results
from .arrays import NUMPY, Array
from .chunking import split_spans
from .group import Group, wait_receipts
from .ops import ReduceOp
from .shm_group import ShmGroup

__all__ = ["all_reduce_hierarchical"]


async def all_reduce_hierarchical(
    local: ShmGroup, ring: Group, src: Array, dst: Array, op: ReduceOp, stage_bytes: int
) -> bool:
    """dst = reduction of src over every rank of every host; see the module docstring."""
    spans = split_spans(len(src), local.size)
    partial = ReduceOp.SUM if op is ReduceOp.AVG else op
    # Phase 1: reduce-scatter inside the host, in shared memory.
    if not await reduce_slices(local, src, spans, partial, stage_bytes):
        return False
    # Phase 2: this rank's slice around the ring of hosts, in place in shared memory.
    lo, hi = spans[local.rank]
    mine = results(local, local.rank, src.dtype, hi - lo)
    if ring.size > 1:
        work = np.empty(hi - lo, dtype=src.dtype)
        pending = await all_reduce_ring(ring, NUMPY, mine, work, mine, partial)
        await wait_receipts(pending)
    if op is ReduceOp.AVG:
        np.divide(mine, local.size * ring.size, out=mine, casting="unsafe")
    await local.sync()
    # Phase 3: all-gather inside the host.
    for j, (a, b) in enumerate(spans):
        if b > a:
            dst[a:b] = results(local, j, src.dtype, b - a)
    return True
