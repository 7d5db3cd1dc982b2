"""Every algorithm of dsml.collectives over the in-memory Group: no sockets, no loop waits."""

from __future__ import annotations

import numpy as np
import pytest

from dsml.collectives import (
    ALL_REDUCE,
    NUMPY,
    all_gather_direct,
    all_to_all_direct,
    barrier_dissemination,
    broadcast_tree,
    check_op,
    gather_direct,
    reduce_scatter_ring,
    reduce_tree,
    scatter_direct,
)
from dsml.collectives.chunking import split_spans
from dsml.errors import CollectiveMismatchError, CollectiveTimeoutError, PeerLostError
from dsml.testing import MemoryNetwork

SIZES = [2, 3, 4, 7]
CHUNK = 64  # bytes: 8 int64 per chunk, so 100 elements take many pipeline chunks


def counts(size: int) -> list[int]:
    return [0, 1, size - 1, 100]


def inputs(size: int, count: int) -> list[np.ndarray]:
    return [np.arange(count, dtype=np.int64) * (rank + 1) + rank for rank in range(size)]


def ok(outcomes: list) -> list:
    for rank, outcome in enumerate(outcomes):
        assert not isinstance(outcome, BaseException), f"rank {rank}: {outcome!r}"
    return outcomes


@pytest.mark.parametrize("algorithm", sorted(ALL_REDUCE))
@pytest.mark.parametrize("size", SIZES)
async def test_every_all_reduce_algorithm_sums_exactly_over_memory(algorithm, size):
    for count in counts(size):
        xs = inputs(size, count)
        expected = sum(xs)
        net = MemoryNetwork(size, chunk_bytes=CHUNK)
        op = check_op("sum", "int64")

        async def run(g, xs=xs, op=op):
            src = xs[g.rank].copy()
            work = np.empty_like(src)
            await ALL_REDUCE[algorithm](g, NUMPY, src, work, src, op)
            return src

        for rank, result in enumerate(ok(await net.run(run))):
            np.testing.assert_array_equal(result, expected, err_msg=f"rank {rank} n={count}")


@pytest.mark.parametrize("op", ["prod", "min", "max"])
async def test_the_ring_applies_every_reduce_op(op):
    size = 3
    xs = [np.array([1, 5, -2, 7], dtype=np.int64) + rank for rank in range(size)]
    reduce = {"prod": np.prod, "min": np.min, "max": np.max}[op]
    expected = reduce(np.stack(xs), axis=0)

    async def run(g):
        src = xs[g.rank].copy()
        await ALL_REDUCE["ring"](g, NUMPY, src, np.empty_like(src), src, check_op(op, "int64"))
        return src

    for result in ok(await MemoryNetwork(size, chunk_bytes=CHUNK).run(run)):
        np.testing.assert_array_equal(result, expected)


@pytest.mark.parametrize("size", SIZES)
async def test_reduce_leaves_the_sum_on_the_root_only(size):
    root = size - 1
    xs = inputs(size, 50)

    async def run(g):
        out = np.zeros(50, dtype=np.int64)
        await reduce_tree(g, NUMPY, xs[g.rank], out, check_op("sum", "int64"), root)
        return out

    outcomes = ok(await MemoryNetwork(size, chunk_bytes=CHUNK).run(run))
    np.testing.assert_array_equal(outcomes[root], sum(xs))


@pytest.mark.parametrize("size", SIZES)
async def test_broadcast_copies_the_roots_array_everywhere(size):
    root = 1 % size
    data = np.arange(77, dtype=np.int64)

    async def run(g):
        buf = data.copy() if g.rank == root else np.zeros(77, dtype=np.int64)
        await broadcast_tree(g, NUMPY, buf, root)
        return buf

    for result in ok(await MemoryNetwork(size, chunk_bytes=CHUNK).run(run)):
        np.testing.assert_array_equal(result, data)


@pytest.mark.parametrize("size", SIZES)
async def test_all_gather_and_gather_concatenate_in_rank_order(size):
    blocks = [np.full((rank + 1, 2), rank, dtype=np.int64) for rank in range(size)]
    expected = np.concatenate(blocks)

    async def gather_all(g):
        b = blocks[g.rank]
        return await all_gather_direct(g, NUMPY, b.reshape(-1), b.shape[0], (2,))

    async def gather_root(g):
        b = blocks[g.rank]
        return await gather_direct(g, NUMPY, b.reshape(-1), b.shape[0], (2,), 0)

    for result in ok(await MemoryNetwork(size, chunk_bytes=CHUNK).run(gather_all)):
        np.testing.assert_array_equal(result, expected)
    outcomes = ok(await MemoryNetwork(size, chunk_bytes=CHUNK).run(gather_root))
    np.testing.assert_array_equal(outcomes[0], expected)
    assert all(o is None for o in outcomes[1:])


@pytest.mark.parametrize("size", SIZES)
async def test_scatter_and_all_to_all_split_like_numpy(size):
    x = np.arange(size * 3 + 1, dtype=np.int64)

    async def scatter(g):
        if g.rank == 0:
            return await scatter_direct(g, NUMPY, x, len(x), (), 0)
        return await scatter_direct(g, NUMPY, None, 0, (), 0)

    for rank, part in enumerate(ok(await MemoryNetwork(size, chunk_bytes=CHUNK).run(scatter))):
        np.testing.assert_array_equal(part, np.array_split(x, size)[rank])

    async def exchange(g):
        mine = x * (g.rank + 1)
        return await all_to_all_direct(g, NUMPY, mine, len(mine), ())

    outcomes = ok(await MemoryNetwork(size, chunk_bytes=CHUNK).run(exchange))
    for rank, got in enumerate(outcomes):
        parts = [np.array_split(x * (src + 1), size)[rank] for src in range(size)]
        np.testing.assert_array_equal(got, np.concatenate(parts))


@pytest.mark.parametrize("size", SIZES)
async def test_reduce_scatter_gives_each_rank_its_reduced_part(size):
    xs = inputs(size, 40)
    spans = split_spans(40, size)

    async def run(g):
        out = np.zeros(40, dtype=np.int64)
        await reduce_scatter_ring(g, NUMPY, xs[g.rank], out, check_op("sum", "int64"), spans)
        lo, hi = spans[g.rank]
        return out[lo:hi]

    for rank, part in enumerate(ok(await MemoryNetwork(size, chunk_bytes=CHUNK).run(run))):
        lo, hi = spans[rank]
        np.testing.assert_array_equal(part, sum(xs)[lo:hi])


@pytest.mark.parametrize("size", SIZES)
async def test_barrier_completes_on_every_rank(size):
    net = MemoryNetwork(size)
    ok(await net.run(barrier_dissemination))
    assert all(n > 0 for n in net.sent)


@pytest.mark.parametrize("algorithm", sorted(ALL_REDUCE))
async def test_a_rank_dying_mid_all_reduce_fails_every_rank_with_peer_lost(algorithm):
    size = 4
    net = MemoryNetwork(size, chunk_bytes=CHUNK)
    net.kill(1, after_sends=2)
    xs = inputs(size, 100)
    originals = [x.copy() for x in xs]

    async def run(g):
        src = xs[g.rank]
        work = np.empty_like(src)
        await ALL_REDUCE[algorithm](g, NUMPY, src, work, work, check_op("sum", "int64"))
        return work

    outcomes = await net.run(run, timeout=5.0)
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, PeerLostError), f"rank {rank}: {outcome!r}"
        assert list(outcome.lost) == [1]
    for x, original in zip(xs, originals, strict=True):
        np.testing.assert_array_equal(x, original)  # inputs intact: results went to work


async def test_ranks_running_different_algorithms_all_fail_with_a_mismatch():
    size = 3
    labels = ["ring", "ring", "tree"]
    xs = inputs(size, 30)

    async def run(g):
        src = xs[g.rank].copy()
        algo = ALL_REDUCE[g.label]
        await algo(g, NUMPY, src, np.empty_like(src), src, check_op("sum", "int64"))
        return src

    outcomes = await MemoryNetwork(size, chunk_bytes=CHUNK).run(run, labels=labels)
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, CollectiveMismatchError), f"rank {rank}: {outcome!r}"


async def test_a_rank_that_never_calls_makes_the_others_time_out_not_hang():
    async def run(g):
        if g.rank == 2:
            return None  # this rank skips the collective
        await barrier_dissemination(g)
        return "done"

    outcomes = await MemoryNetwork(3).run(run, timeout=0.2)
    assert outcomes[2] is None
    assert any(isinstance(o, CollectiveTimeoutError) for o in outcomes[:2]), outcomes
