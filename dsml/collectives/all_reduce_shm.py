"""All-reduce through shared memory between the ranks of one host (collectives layer).

Three schedules, chosen by size and group size (the same on every rank):

* small (the whole array fits an inline area, and P x n <= 4 MiB): every rank writes
  its input into its inline area, one sync, and every rank reduces the whole array
  itself, reading the peers' inline areas in rank order, straight into `dst`. One sync,
  P x n reads per rank; the same inputs in the same order give every rank the same bits.
* pair (two ranks, up to PAIR_BYTES, and only where staging all of the input needs no
  more room than the large schedule's n/2 results and `stage_bytes` of staging): no
  slices. Piece by piece (512 KiB), each rank
  copies its input's piece into its staging, one sync, and reduces the piece from its
  input (still in cache) and the peer's staging, in rank order, straight into `dst`;
  one more sync at the end (the peer is done reading). Per rank: n copied in, n read
  from the peer, n written; K+1 syncs for K pieces. With two operands a op b and b op a
  are the same bits, so both ranks end alike. `dst` is written while the call runs, but
  the staging keeps the whole input (never reused within a call), so a failure copies
  the written part back from there when `dst` is `src`: no extra pass unless the call
  fails. Why not the large schedule at two ranks: its two staging buffers are rewritten
  every other piece while the peer still caches them, which some placements of the two
  CPUs (a VM's vCPUs far apart: cache-to-cache transfers 5x slower) make about 2x
  slower; the pair writes each staging line once per call and stays as fast there.
  The price: the whole input in /dev/shm and about 3x the array in resident memory
  (against 2.1x), and with both CPUs close it is 0-15% slower than the large schedule
  at 8-16 MiB (faster up to 4 MiB); so up to 16 MiB only.
* large: slices, as in a reduce-scatter + all-gather. Rank r owns slice r. The slices go
  through in pieces (512 KiB at 2 ranks, 768 KiB / (P-1) beyond: 256 KiB at 4; two
  pieces' staging within `stage_bytes`). For piece p: every rank copies piece p of its
  input's slices j != r into staging buffer p % 2 (P-1 slots at the end of its data
  area); sync; rank r reduces piece p of slice r from its own input and the peers'
  buffers, in rank order, straight into its results (the start of its data area). Two
  buffers make one sync per piece enough: a rank writes buffer p % 2 only after the sync
  of piece p-1, which every peer posts after reducing piece p-2 out of it. Small pieces
  keep the staged bytes in cache until their owner reduces them. After the last piece,
  one more sync (every slice is final), then every rank copies the slices from the
  owners' results into `dst`. Per rank: copies in (P-1)/P n, reads n and writes n/P to
  reduce, copies out n; K+1 syncs for K pieces (2 when one piece holds the slices). The
  results of all pieces stay in shared memory until the end, so `dst` (often the
  caller's input) is written only once every rank has finished: a failure leaves it
  untouched.

Preconditions: `src` and `dst` flat numpy arrays of one dtype and length (`dst` may be
`src`); every rank passes the same length, dtype and op (checked by the first sync).
Returns False, having written nothing, when some rank had no room in /dev/shm.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .arrays import Array
from .chunking import split_spans
from .ops import UFUNCS, ReduceOp
from .shm_group import ShmGroup, staging

__all__ = ["all_reduce_shm", "reduce_into", "reduce_slices", "results"]

BLOCK_BYTES = 256 << 10  # reduce in blocks that stay in L2 while the inputs stream past
#: the small schedule reads every rank's whole input: worth a sync less up to this much
SMALL_READ_BYTES = 4 << 20
#: large arrays: staged per slice in pieces of at most this size, double-buffered, so a
#: piece staged by one rank is still in cache when its owner reduces it ...
PIECE_BYTES = 512 << 10
#: ... and one buffer's P-1 pieces at most this much (two buffers fit a 2 MiB L2;
#: measured at 4 ranks on 2 cores: 256 KiB pieces 6% faster than 512 KiB)
BUFFER_BYTES = 768 << 10
#: a call's syncs are numbered within one byte of the link's progress word (254 at most);
#: the large schedule's pieces (a sync each) stay below this, leaving room for the
#: hierarchical all_reduce's and reduce_scatter's own syncs
MAX_PIECES = 240
#: two ranks: arrays up to this size are staged whole, each rank reducing all of it
PAIR_BYTES = 16 << 20
#: ... piece by piece (a sync each), so the staged piece is still in cache
PAIR_PIECE_BYTES = 512 << 10


async def all_reduce_shm(
    group: ShmGroup, src: Array, dst: Array, op: ReduceOp, stage_bytes: int
) -> bool:
    """dst = reduction over the host's ranks of src; False if it could not run here."""
    if src.nbytes <= group.inline_bytes and src.nbytes * group.size <= SMALL_READ_BYTES:
        return await _small(group, src, dst, op)
    if group.size == 2 and src.nbytes <= min(PAIR_BYTES, stage_bytes + src.nbytes // 2):
        return await _pair(group, src, dst, op)  # no more room than the large schedule
    return await _large(group, src, dst, op, stage_bytes)


async def _small(group: ShmGroup, src: Array, dst: Array, op: ReduceOp) -> bool:
    n, dtype = len(src), src.dtype
    group.inline(group.rank)[: src.nbytes] = src.view(np.uint8)
    await group.sync()
    # Our own input is read back from the inline area too: dst may be src.
    nbytes = src.nbytes
    inputs = [area[:nbytes].view(dtype) for area in group.inlines()]
    if src.nbytes > BLOCK_BYTES or len(inputs) < 2:
        reduce_into(dst, inputs, op, 0, n)
    else:  # one block: what reduce_into does, without its slicing (a few us per call)
        ufunc = UFUNCS[op]
        ufunc(inputs[0], inputs[1], out=dst)
        for extra in inputs[2:]:
            ufunc(dst, extra, out=dst)
    if op is ReduceOp.AVG:
        np.divide(dst, group.size, out=dst, casting="unsafe")
    return True


async def _pair(group: ShmGroup, src: Array, dst: Array, op: ReduceOp) -> bool:
    n, dtype, rank = len(src), src.dtype, group.rank
    step = max(1, PAIR_PIECE_BYTES // dtype.itemsize)
    room = group.reserve(0, src.nbytes)
    stage = staging(group.area(rank), src.nbytes).view(dtype) if room else src[:0]
    ufunc = UFUNCS[op]
    written = 0  # dst[:written] holds results; our input's copy is stage[:written]
    try:
        for a in range(0, n, step):
            b = min(a + step, n)
            if room:
                stage[a:b] = src[a:b]
            if not await group.sync(room) and a == 0:
                return False  # some rank has no room: nothing was written yet
            peer = staging(group.area(1 - rank), src.nbytes).view(dtype)[a:b]
            pair = (src[a:b], peer) if rank == 0 else (peer, src[a:b])
            written = b
            ufunc(*pair, out=dst[a:b])
            if op is ReduceOp.AVG:
                np.divide(dst[a:b], 2, out=dst[a:b], casting="unsafe")
        await group.sync()  # the peer is done reading our staging
    except BaseException:
        if written and np.shares_memory(src, dst):
            dst[:written] = stage[:written]  # the input as it was
        raise
    return True


async def _large(group: ShmGroup, src: Array, dst: Array, op: ReduceOp, stage_bytes: int) -> bool:
    spans = split_spans(len(src), group.size)
    if not await reduce_slices(group, src, spans, op, stage_bytes):
        return False
    # Phase 3: every slice is final in its owner's results: copy them all out.
    for j, (lo, hi) in enumerate(spans):
        if hi > lo:
            dst[lo:hi] = results(group, j, src.dtype, hi - lo)
    return True


async def reduce_slices(
    group: ShmGroup, src: Array, spans: list[tuple[int, int]], op: ReduceOp, stage_bytes: int
) -> bool:
    """Reduce span r of everyone's src into rank r's results area (see the module doc);
    False when some rank had no room. The results stay there until the next call."""
    size, rank, dtype, itemsize = group.size, group.rank, src.dtype, src.dtype.itemsize
    lo_r, hi_r = spans[rank]
    slot, pieces = piece_plan(max(hi - lo for lo, hi in spans), size, itemsize, stage_bytes)
    buffers = 2 if pieces > 1 else 1
    per_buffer = (size - 1) * slot  # elements: a slot per other rank's slice
    stage_bytes = buffers * per_buffer * itemsize
    room = group.reserve((hi_r - lo_r) * itemsize, stage_bytes)
    out, peers = src[:0], []  # our results and the peers' staging, after the first sync
    for p in range(pieces):
        at = (p % buffers) * per_buffer
        # Phase 1: stage piece p of every slice but our own, into buffer p % 2. Peers
        # read that buffer last for piece p - 2, before posting the previous sync.
        if room:
            stage = staging(group.area(rank), stage_bytes).view(dtype)
            for j, (lo, hi) in enumerate(spans):
                a, b = min(lo + p * slot, hi), min(lo + (p + 1) * slot, hi)
                if j != rank and b > a:
                    to = at + _slot(j, rank) * slot
                    stage[to : to + b - a] = src[a:b]
        if not await group.sync(room) and p == 0:
            return False  # some rank has no room: nothing was written yet
        if p == 0:
            out = results(group, rank, dtype, hi_r - lo_r)
            peers = [staging(group.area(j), stage_bytes).view(dtype) for j in range(size)]
        # Phase 2: reduce our slice's piece p from everyone's input, into our results.
        a, b = min(lo_r + p * slot, hi_r), min(lo_r + (p + 1) * slot, hi_r)
        if b > a:
            inputs = [
                src[a:b] if j == rank else peers[j][at + _slot(rank, j) * slot :]
                for j in range(size)
            ]
            piece = out[a - lo_r : b - lo_r]
            reduce_into(piece, inputs, op, 0, b - a)
            if op is ReduceOp.AVG:
                np.divide(piece, size, out=piece, casting="unsafe")
        if buffers == 1 or p == pieces - 1:
            await group.sync()  # staging may be written again; after the last: all done
    return True


def piece_plan(longest: int, size: int, itemsize: int, stage_bytes: int) -> tuple[int, int]:
    """(elements per slice and piece, number of pieces) for slices of up to `longest`
    elements: pieces of at most PIECE_BYTES per slice and BUFFER_BYTES per buffer, in two
    staging buffers that fit `stage_bytes` together (one buffer when a single piece holds
    the slices). At most MAX_PIECES pieces, a sync each, so a call's phases fit the link's
    counter: for huge slices (or a tiny `stage_bytes`) pieces grow past those sizes. It
    depends on the arguments only, so every rank plans alike."""
    others = max(1, size - 1)
    piece_bytes = min(PIECE_BYTES, BUFFER_BYTES // others)  # from P only: ranks agree
    slot = max(1, min(piece_bytes, stage_bytes // (2 * others)) // itemsize)
    if longest <= slot or longest * others * itemsize <= min(stage_bytes, piece_bytes):
        return max(1, longest), 1
    slot = max(slot, -(-longest // MAX_PIECES))
    return slot, -(-longest // slot)


def results(group: ShmGroup, rank: int, dtype: Any, count: int) -> Array:
    """The first `count` elements of a rank's results (at the start of its data area)."""
    return group.area(rank)[: count * np.dtype(dtype).itemsize].view(dtype)


def _slot(slice_: int, writer: int) -> int:
    """Where `writer` stages slice `slice_` (it stages every slice but its own)."""
    return slice_ if slice_ < writer else slice_ - 1


def reduce_into(out: Array, inputs: list[Array], op: ReduceOp, lo: int, hi: int) -> None:
    """out[:hi-lo] = inputs[0][lo:hi] op inputs[1][lo:hi] op ... (in list order), by blocks."""
    ufunc = UFUNCS[op]
    if len(inputs) == 1:
        out[: hi - lo] = inputs[0][lo:hi]
        return
    block = max(1, BLOCK_BYTES // out.dtype.itemsize)
    for start in range(lo, hi, block):
        stop = min(start + block, hi)
        o = out[start - lo : stop - lo]
        ufunc(inputs[0][start:stop], inputs[1][start:stop], out=o)
        for extra in inputs[2:]:
            ufunc(o, extra[start:stop], out=o)
