"""Measuring a group's links and agreeing on one cost model (collectives layer).

Run by every rank of a new view, like a collective, before any `auto` call of that view.
Each rank measures the link to its right ring neighbour; rank 0 gathers the samples, fits
a `CostModel` (cost.py) and sends it to everyone, so every rank holds the same numbers
and `auto` picks the same algorithm everywhere (choices computed apart from local
samples could differ, and a mismatch would fail the call).

Per link (rank r to r+1), in two phases so that a rank is not pinging and answering a
ping at the same moment (odd P: rank 0 does both in phase 0; samples stay usable):

1. ping-pong of a small message, `_ROUNDS` times after one warm-up: latency;
2. `_BURST` small messages back to back, answered once: time per extra message;

then, with every link busy at once as in a ring step (this is what the ring sees, CPU
contention included): every rank sends two messages of `_RATE_BYTES` to the right, and
the gap between the arrivals of the left neighbour's two is the sustained seconds per
byte (`_ROUNDS` times after a warm-up); the CPU time per extra message when `_CPU_BYTES`
go in `_PIECES` messages rather than one. Then the ring and the mesh race on a
`_RACE_BYTES` all-reduce: the ring's time bounds the per-byte time from below (if the ring
got less than the link's rate, that is what the ring will get), and the mesh's time next
to the ring's says what flows to every peer at once cost per byte (mesh, naive, direct).
The ring races once more with `_SPLIT` chunks per segment: the per-message time is raised
to what makes the formula lose (or gain) as much by those chunks as the real ring did,
which is a lot where the CPU, not the link, is the limit. Last, every algorithm races at
each of `_RACED_SIZES`: the model predicts from these times where they reach (cost.py).
The raced algorithms' messages follow the probe's own on every link, in order, so they
cannot be confused with them.
Rank 0 also times a local reduction (numpy add) and copy for the per-byte CPU costs.

Cost: about 2(2 + _ROUNDS + _BURST) small messages per link, and (_ROUNDS + 1) times
2 x _RATE_BYTES + 2 x _CPU_BYTES + 3 x _RACE_BYTES sent per rank, plus the races: about
1.1 s at 1 Gbit (mostly naive and direct at _RACE_BYTES), 0.5 s at 10 Gbit; once per view.

The samples and the fit of the model to them are in cost_samples.py; taking the samples,
timing the races and agreeing on rank 0's model are here.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .all_reduce_direct import all_reduce_direct
from .all_reduce_mesh import all_reduce_mesh
from .all_reduce_naive import all_reduce_naive
from .all_reduce_ring import all_reduce_ring
from .all_reduce_tree import all_reduce_tree
from .arrays import NUMPY
from .cost import CostModel
from .cost_samples import _BURST, _RACE_BYTES, _RATE_BYTES, _SPLIT, LinkSample, model_from_samples
from .group import Group, Receipt, wait_receipts
from .ops import ReduceOp

__all__ = ["PROBE_FRAME_BYTES", "LinkSample", "WithChunk", "measure_cost", "model_from_samples"]

_SMALL_BYTES = 64
_CPU_BYTES = 512 * 1024
#: The largest message the probe sends (frames must be allowed to be this large).
PROBE_FRAME_BYTES = max(_RATE_BYTES, _CPU_BYTES, _RACE_BYTES)
_ROUNDS = 3
_PIECES = 8  # a shift in this many messages, for the CPU cost of a chunk
_REDUCE_BYTES = 4 << 20  # larger than a cache, as the arrays worth choosing for
#: Sizes at which every algorithm is raced (what hops, messages and bytes really cost);
#: at _RACE_BYTES the ring and the mesh were raced already.
_RACED_SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, _RACE_BYTES)
_SMALL_ROUNDS = 7  # timed rounds below _RACE_BYTES: cheap there, and noisier
_ALGORITHMS: dict[str, Any] = {
    "ring": all_reduce_ring,
    "mesh": all_reduce_mesh,
    "tree": all_reduce_tree,
    "naive": all_reduce_naive,
    "direct": all_reduce_direct,
}

# Steps of the probe's messages (chunk numbers count messages within a step).
_PING, _PONG = 0, 1  # + 2 * phase
_SYNC, _SHIFT, _PIECE = 4, 5, 6
_SAMPLE, _MODEL = 7, 8  # (the raced algorithms number their own steps from 0)


class WithChunk:
    """`group` as a `Group` whose pipeline chunk is `chunk_bytes` (the model's choice).

    `send` and `recv` are the group's own bound methods, not wrappers: `auto` runs every
    call through this, and a wrapper coroutine per message shows on small arrays.
    """

    def __init__(self, group: Group, chunk_bytes: int) -> None:
        self._group = group
        self.chunk_bytes = chunk_bytes
        self.send = group.send
        self.recv = group.recv

    @property
    def rank(self) -> int:
        return self._group.rank

    @property
    def size(self) -> int:
        return self._group.size


async def measure_cost(
    group: Group, host_keys: Sequence[str], *, default_chunk_bytes: int, max_chunk_bytes: int
) -> CostModel:
    """Measure this group and return the model rank 0 fitted (identical on every rank).

    `host_keys[r]` names the host of rank r (equal keys: the same machine).
    """
    size, rank = group.size, group.rank
    assert len(host_keys) == size
    fit = {"default_chunk_bytes": default_chunk_bytes, "max_chunk_bytes": max_chunk_bytes}
    if size == 1:
        return model_from_samples([LinkSample(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)], host_keys, 0.0, **fit)
    sent: list[Receipt] = []
    right, left = (rank + 1) % size, (rank - 1) % size
    rtt = burst = 0.0
    for phase in (0, 1):  # rank r pings in phase r % 2, so most ranks do one thing at a time
        if rank % 2 == phase and left % 2 == phase:  # odd P: rank 0 does both in phase 0
            (rtt, burst), _ = await asyncio.gather(
                _ping(group, right, phase, sent), _pong(group, left, phase, sent)
            )
        elif rank % 2 == phase:
            rtt, burst = await _ping(group, right, phase, sent)
        elif left % 2 == phase:
            await _pong(group, left, phase, sent)
    shift, chunk_cpu = await _shift(group, right, left, sent)
    ring, mesh, split = await _race(group, sent)
    raced = await _race_all(group, sent)
    mine = LinkSample(rtt, burst, shift, chunk_cpu, ring, mesh, split, raced)
    if rank != 0:
        sent.append(await group.send(0, _SAMPLE, meta=mine.to_fields()))
        msg = await group.recv(0, _MODEL, nbytes=0)
        await wait_receipts(sent)
        return CostModel.from_fields(msg.meta or {})
    samples = [mine]
    for peer in range(1, size):
        samples.append(LinkSample.from_fields((await group.recv(peer, _SAMPLE, nbytes=0)).meta))
    model = model_from_samples(samples, host_keys, _reduce_time(), copy_s=_copy_time(), **fit)
    for peer in range(1, size):
        sent.append(await group.send(peer, _MODEL, meta=model.to_fields()))
    await wait_receipts(sent)
    return model


async def _ping(group: Group, peer: int, phase: int, sent: list[Receipt]) -> tuple[float, float]:
    """Small round trips, then a burst; returns (median round trip, burst time)."""
    small = memoryview(bytes(_SMALL_BYTES))
    ping, pong = _PING + 2 * phase, _PONG + 2 * phase
    rtts = []
    for i in range(_ROUNDS + 1):
        start = time.perf_counter()
        sent.append(await group.send(peer, ping, i, small))
        await group.recv(peer, pong, i, nbytes=_SMALL_BYTES)
        rtts.append(time.perf_counter() - start)
    start = time.perf_counter()
    for j in range(_BURST):
        sent.append(await group.send(peer, ping, _ROUNDS + 1 + j, small))
    await group.recv(peer, pong, _ROUNDS + 1, nbytes=_SMALL_BYTES)
    burst = time.perf_counter() - start
    return statistics.median(rtts[1:]), burst


async def _pong(group: Group, peer: int, phase: int, sent: list[Receipt]) -> None:
    """The other end of `_ping`: answer each round trip, and the burst once."""
    ping, pong = _PING + 2 * phase, _PONG + 2 * phase
    for i in range(_ROUNDS + 1):
        msg = await group.recv(peer, ping, i, nbytes=_SMALL_BYTES)
        sent.append(await group.send(peer, pong, i, msg.payload))
    for j in range(_BURST):
        msg = await group.recv(peer, ping, _ROUNDS + 1 + j, nbytes=_SMALL_BYTES)
    sent.append(await group.send(peer, pong, _ROUNDS + 1, msg.payload))


async def _shift(group: Group, right: int, left: int, sent: list[Receipt]) -> tuple[float, float]:
    """Every rank sends to the right at once, as in a ring step. Returns (median time
    between the arrivals of two back-to-back messages of _RATE_BYTES from the left, median
    CPU time per extra message when _CPU_BYTES go in _PIECES messages instead of one).

    The gap between two arrivals is the link's sustained rate: a shaper's token bucket
    (or a switch buffer) can speed up the first message, not the second. Where the CPU,
    not the link, is the limit, the gap flatters (the receiver handles a message while the
    next one is already on its way), so half the time of both counts if it is longer. CPU time (this
    process, ZeroMQ's I/O thread included) rather than wall time: on a loaded machine it
    still says what a message costs, and it counts the large zero-copy messages chunking
    makes, which cost more than the small ones of the burst.
    """
    rate = memoryview(bytearray(2 * _RATE_BYTES))
    gaps, extra_cpu = [], []
    for i in range(_ROUNDS + 1):
        await _sync(group, right, left, 3 * i, sent)
        start = time.perf_counter()
        for j in range(2):
            piece = rate[j * _RATE_BYTES : (j + 1) * _RATE_BYTES]
            sent.append(await group.send(right, _SHIFT, 2 * i + j, piece))
        await group.recv(left, _SHIFT, 2 * i, nbytes=_RATE_BYTES)
        first = time.perf_counter()
        await group.recv(left, _SHIFT, 2 * i + 1, nbytes=_RATE_BYTES)
        end = time.perf_counter()
        gaps.append(max(end - first, (end - start) / 2))
        await wait_receipts(sent)  # buffers are reused: ZeroMQ must be done with them
        cpu = []
        for variant, parts in enumerate((1, _PIECES)):
            await _sync(group, right, left, 3 * i + 1 + variant, sent)
            start_cpu, size = time.process_time(), _CPU_BYTES // parts
            for j in range(parts):
                piece = rate[j * size : (j + 1) * size]
                sent.append(await group.send(right, _PIECE, i * (1 + _PIECES) + variant + j, piece))
            for j in range(parts):
                await group.recv(left, _PIECE, i * (1 + _PIECES) + variant + j, nbytes=size)
            await wait_receipts(sent)
            cpu.append(time.process_time() - start_cpu)
        extra_cpu.append(max(0.0, cpu[1] - cpu[0]) / (_PIECES - 1))
    return statistics.median(gaps[1:]), statistics.median(extra_cpu[1:])


async def _sync(group: Group, right: int, left: int, n: int, sent: list[Receipt]) -> None:
    """A token around the ring, so that ranks start the next measurement about together."""
    sent.append(await group.send(right, _SYNC, n))
    await group.recv(left, _SYNC, n, nbytes=0)


async def _race(group: Group, sent: list[Receipt]) -> tuple[float, float, float]:
    """Time the ring and the mesh on one _RACE_BYTES all-reduce each, as the algorithms
    really run (median of _ROUNDS after a warm-up): what flows to every peer at once cost
    next to one flow to a neighbour, which no formula knows on a given network; and the
    ring again with _SPLIT chunks per segment: what a chunk costs where it runs."""
    segment = -(-_RACE_BYTES // group.size)
    races = [
        (all_reduce_ring, WithChunk(group, _RACE_BYTES)),  # one chunk per segment
        (all_reduce_mesh, WithChunk(group, _RACE_BYTES)),
        (all_reduce_ring, WithChunk(group, -(-segment // _SPLIT))),
    ]
    first_sync = 3 * (_ROUNDS + 1)  # after _shift's
    medians = []
    for a, (algorithm, chunked) in enumerate(races):
        sync = first_sync + a * (_ROUNDS + 1)
        medians.append(await _time(group, chunked, algorithm, _RACE_BYTES, sync, sent))
    return medians[0], medians[1], medians[2]


async def _race_all(group: Group, sent: list[Receipt]) -> tuple[tuple[str, int, float], ...]:
    """Every algorithm at each of _RACED_SIZES (one chunk per stream): what their hops,
    messages and bytes cost on this group, shaper bursts and shared cores included, which
    no formula knows (on cores shared by several "hosts", a rank doing more than its share
    of the work, as naive's rank 0 does, costs less than the formula says)."""
    sync = 6 * (_ROUNDS + 1)  # after _shift's and _race's
    rows = []
    for nbytes in _RACED_SIZES:
        rounds = _ROUNDS if nbytes >= _RACE_BYTES else _SMALL_ROUNDS
        # (at _RACE_BYTES the ring and the mesh were raced by _race)
        names = [n for n in _ALGORITHMS if nbytes < _RACE_BYTES or n not in ("ring", "mesh")]
        medians = await _race_size(group, nbytes, names, sync, sent, rounds)
        rows += [(name, nbytes, seconds) for name, seconds in zip(names, medians, strict=True)]
        sync += (rounds + 1) * len(names)
    return tuple(rows)


async def _race_size(
    group: Group, nbytes: int, names: list[str], sync: int, sent: list[Receipt], rounds: int
) -> list[float]:
    """Median seconds of each named algorithm on nbytes (float32 sum, one chunk per
    stream) over `rounds` after a warm-up, the algorithms taking turns call by call: a
    slow spell of a busy host then falls on each alike, where blocks of calls timed one
    algorithm after the other let it decide the race (on 4 namespaced hosts sharing 2
    cores, auto's choice at 64 KiB changed from one probe to the next). Each round takes
    them in another order (`round_order`), so none always follows the same one: what a
    call leaves behind, such as a shaper's token bucket emptied by direct's (P-1) n bytes
    per rank, would otherwise always fall on the same algorithm (8-11% at 256 KiB, 1 Gbit).
    Each call is started by a token around the ring (sync numbers from `sync` on)."""
    right, left = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    whole = WithChunk(group, nbytes)
    src = np.ones(nbytes // 4, dtype=np.float32)
    work, dst = np.empty_like(src), np.empty_like(src)
    times: list[list[float]] = [[] for _ in names]
    for i in range(rounds + 1):
        for k, j in enumerate(round_order(i, len(names))):
            name = names[j]
            await _sync(group, right, left, sync + i * len(names) + k, sent)
            start = time.perf_counter()
            pending = await _ALGORITHMS[name](whole, NUMPY, src, work, dst, ReduceOp.SUM)
            times[j].append(time.perf_counter() - start)
            await wait_receipts(pending)
    return [statistics.median(t[1:]) for t in times]


def round_order(i: int, n: int) -> list[int]:
    """A permutation of range(n) for round i, shuffled by a fixed integer generator: the
    same on every rank (no `random`, whose algorithms may differ between Python versions)
    and different from round to round."""
    order, state = list(range(n)), (i * 2654435761 + 1) & 0x7FFFFFFF
    for k in range(n - 1, 0, -1):
        state = (state * 1103515245 + 12345) & 0x7FFFFFFF
        j = (state >> 16) % (k + 1)  # (an LCG's low bits repeat)
        order[k], order[j] = order[j], order[k]
    return order


async def _time(
    group: Group,
    chunked: Group,
    algorithm: Any,
    nbytes: int,
    sync: int,
    sent: list[Receipt],
    rounds: int = _ROUNDS,
) -> float:
    """Median seconds of `algorithm` on nbytes (float32 sum) over `rounds` after a warm-up,
    each round started by a token around the ring (sync numbers sync .. sync+rounds)."""
    right, left = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    src = np.ones(nbytes // 4, dtype=np.float32)
    work, dst = np.empty_like(src), np.empty_like(src)
    times = []
    for i in range(rounds + 1):
        await _sync(group, right, left, sync + i, sent)
        start = time.perf_counter()
        pending = await algorithm(chunked, NUMPY, src, work, dst, ReduceOp.SUM)
        times.append(time.perf_counter() - start)
        await wait_receipts(pending)
    return statistics.median(times[1:])


def _copy_time() -> float:
    """Seconds per byte of copying one array into another (median of a few)."""
    return _per_byte(lambda a, b: np.copyto(a, b))


def _reduce_time() -> float:
    """Seconds per byte of a float32 sum into an array (median of a few)."""
    return _per_byte(lambda a, b: np.add(a, b, out=a))


def _per_byte(work: Callable[[np.ndarray, np.ndarray], object]) -> float:
    a = np.ones(_REDUCE_BYTES // 4, dtype=np.float32)
    b = np.ones_like(a)
    times = []
    for _ in range(_ROUNDS):
        start = time.perf_counter()
        work(a, b)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / _REDUCE_BYTES
