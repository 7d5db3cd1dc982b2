"""Every collective x op x dtype, world sizes 1-4 and 7, counts 0, 1, < world size, large.

Inputs are integer-valued, so results must equal numpy's exactly in any summation order,
and every rank must hold the same bytes. A small chunk size makes "large" arrays (10,000
elements) cross many pipeline chunks and the zero-copy path without costing test time.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import dsml
from dsml import CommConfig
from dsml.testing import open_local_cluster
from tests.reference import DTYPE_NAMES, OPS, dtype, inputs, reduce_reference, same_bytes, valid

WORLD_SIZES = [1, 2, 3, 4, 7]
SMALL_CHUNKS = CommConfig(chunk_bytes=4096, zero_copy_min_bytes=1024, timeout=30)
LARGE = 10_000


def counts(world_size: int) -> list[int]:
    return sorted({0, 1, max(world_size - 1, 0), LARGE})


@pytest.mark.parametrize("name", DTYPE_NAMES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_all_reduce_matches_numpy_and_is_identical_on_every_rank(world_size, name, seed):
    async with open_local_cluster(world_size, config=SMALL_CHUNKS) as cluster:
        for op in filter(lambda o: valid(o, name), OPS):
            for algorithm in ("ring", "tree", "naive", "direct", "mesh", "auto"):
                for count in counts(world_size):
                    xs = inputs(name, op, count, world_size, seed + count)
                    expected = reduce_reference(op, xs)
                    arrays = [x.copy() for x in xs]
                    results = await cluster.run(
                        lambda c: c.all_reduce(arrays[c.rank], op, algorithm=algorithm)
                    )
                    where = f"{op} {algorithm} count={count}"
                    assert all(r is a for r, a in zip(results, arrays, strict=True)), where
                    assert same_bytes(results), where
                    np.testing.assert_array_equal(results[0], expected, err_msg=where)


@pytest.mark.parametrize("name", DTYPE_NAMES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_reduce_gives_root_the_reduction_and_leaves_others_alone(world_size, name, seed):
    async with open_local_cluster(world_size, config=SMALL_CHUNKS) as cluster:
        root = world_size - 1
        for op in filter(lambda o: valid(o, name), OPS):
            for count in counts(world_size):
                xs = inputs(name, op, count, world_size, seed + count)
                arrays = [x.copy() for x in xs]
                results = await cluster.run(lambda c: c.reduce(arrays[c.rank], root, op))
                np.testing.assert_array_equal(results[root], reduce_reference(op, xs))
                for rank in range(world_size - 1):
                    assert results[rank] is None
                    assert arrays[rank].tobytes() == xs[rank].tobytes()


@pytest.mark.parametrize("name", DTYPE_NAMES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_broadcast_copies_the_root_array_everywhere(world_size, name, seed):
    async with open_local_cluster(world_size, config=SMALL_CHUNKS) as cluster:
        root = world_size // 2
        for count in counts(world_size):
            xs = inputs(name, "sum", count, world_size, seed + count)
            arrays = [x.copy() for x in xs]
            results = await cluster.run(lambda c: c.broadcast(arrays[c.rank], root))
            assert all(r is a for r, a in zip(results, arrays, strict=True))
            assert same_bytes(results)
            np.testing.assert_array_equal(results[0], xs[root])


def _rows(rank: int, count: int) -> int:
    """First-axis lengths that differ between ranks (some zero)."""
    return (count + rank) % 4 if count else 0


@pytest.mark.parametrize("name", DTYPE_NAMES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_all_gather_concatenates_blocks_of_any_length_in_rank_order(world_size, name, seed):
    async with open_local_cluster(world_size, config=SMALL_CHUNKS) as cluster:
        for count in counts(world_size):
            xs = [
                x.reshape(-1, 1)[: max(_rows(r, count), 0)].repeat(3, axis=1)
                for r, x in enumerate(inputs(name, "sum", count + 3, world_size, seed + count))
            ]
            if count == LARGE:
                xs = [x.reshape(-1) for x in inputs(name, "sum", count, world_size, seed)]
            results = await cluster.run(lambda c: c.all_gather(xs[c.rank]))
            assert same_bytes(results)
            np.testing.assert_array_equal(results[0], np.concatenate(xs))


@pytest.mark.parametrize("name", DTYPE_NAMES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_gather_collects_blocks_on_the_root_only(world_size, name, seed):
    async with open_local_cluster(world_size, config=SMALL_CHUNKS) as cluster:
        root = world_size - 1
        for count in counts(world_size):
            xs = [
                x[: _rows(r, count) or count]
                for r, x in enumerate(inputs(name, "sum", count, world_size, seed + count))
            ]
            results = await cluster.run(lambda c: c.gather(xs[c.rank], root))
            np.testing.assert_array_equal(results[root], np.concatenate(xs))
            assert results[root].dtype == dtype(name)
            assert all(r is None for i, r in enumerate(results) if i != root)


@pytest.mark.parametrize("name", DTYPE_NAMES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_scatter_gives_rank_r_its_array_split_part(world_size, name, seed):
    async with open_local_cluster(world_size, config=SMALL_CHUNKS) as cluster:
        root = 0
        for count in counts(world_size):
            x = inputs(name, "sum", count * 2, 1, seed + count)[0].reshape(count, 2)
            results = await cluster.run(lambda c: c.scatter(x if c.rank == root else None, root))
            for rank, part in enumerate(np.array_split(x, world_size)):
                np.testing.assert_array_equal(results[rank], part)
                assert results[rank].dtype == part.dtype
                assert results[rank].shape == part.shape


@pytest.mark.parametrize("name", DTYPE_NAMES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_reduce_scatter_gives_rank_r_the_reduced_part_r(world_size, name, seed):
    async with open_local_cluster(world_size, config=SMALL_CHUNKS) as cluster:
        for op in filter(lambda o: valid(o, name), OPS):
            for count in counts(world_size):
                xs = inputs(name, op, count, world_size, seed + count)
                results = await cluster.run(lambda c: c.reduce_scatter(xs[c.rank], op))
                expected = np.array_split(reduce_reference(op, xs), world_size)
                for rank in range(world_size):
                    np.testing.assert_array_equal(results[rank], expected[rank], err_msg=op)
                    assert results[rank].dtype == dtype(name)


@pytest.mark.parametrize("name", DTYPE_NAMES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_all_to_all_exchanges_array_split_parts(world_size, name, seed):
    async with open_local_cluster(world_size, config=SMALL_CHUNKS) as cluster:
        for count in counts(world_size):
            xs = [x.reshape(-1, 1) for x in inputs(name, "sum", count, world_size, seed + count)]
            results = await cluster.run(lambda c: c.all_to_all(xs[c.rank]))
            for rank in range(world_size):
                parts = [np.array_split(x, world_size)[rank] for x in xs]
                np.testing.assert_array_equal(results[rank], np.concatenate(parts))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
async def test_barrier_returns_on_every_rank(world_size):
    async with open_local_cluster(world_size) as cluster:
        assert await cluster.run(lambda c: c.barrier()) == [None] * world_size


@pytest.mark.parametrize("world_size", [2, 3, 4])
async def test_strided_and_multidimensional_arrays_are_reduced_in_place(world_size):
    async with open_local_cluster(world_size, config=SMALL_CHUNKS) as cluster:
        bases = [
            np.arange(6 * 40, dtype=np.int64).reshape(6, 40) * (r + 1) for r in range(world_size)
        ]
        views = [b[::2, 1::3] for b in bases]  # neither C- nor F-contiguous
        expected = sum(v.copy() for v in views)
        untouched = [b[1::2].copy() for b in bases]
        await cluster.run(lambda c: c.all_reduce(views[c.rank], algorithm="ring"))
        for base, view, rows in zip(bases, views, untouched, strict=True):
            np.testing.assert_array_equal(view, expected)
            np.testing.assert_array_equal(base[1::2], rows)  # only the view was written
        fortran = [np.asfortranarray(np.ones((5, 7)) * r) for r in range(world_size)]
        await cluster.run(lambda c: c.all_reduce(fortran[c.rank], "max"))
        assert all((f == world_size - 1).all() for f in fortran)


async def test_zero_dimensional_arrays_count_as_one_element():
    async with open_local_cluster(3) as cluster:
        scalars = [np.array(float(r + 1)) for r in range(3)]
        await cluster.run(lambda c: c.all_reduce(scalars[c.rank]))
        assert [float(s) for s in scalars] == [6.0, 6.0, 6.0]
        gathered = await cluster.run(lambda c: c.all_gather(np.array(c.rank)))
        assert gathered[0].tolist() == [0, 1, 2]


async def test_non_native_byte_order_is_reduced_and_written_back_in_that_order():
    async with open_local_cluster(2) as cluster:
        xs = [(np.arange(10) + r).astype(">i4") for r in range(2)]
        await cluster.run(lambda c: c.all_reduce(xs[c.rank]))
        assert xs[0].dtype == np.dtype(">i4")
        np.testing.assert_array_equal(xs[0], np.arange(10) * 2 + 1)


async def test_concurrent_collectives_match_by_program_order():
    async with open_local_cluster(4) as cluster:

        async def many(comm):
            arrays = [np.full(100 * (i + 1), comm.rank + i, dtype=np.int64) for i in range(8)]
            handles = [
                comm.all_reduce(a, algorithm=("ring", "tree")[i % 2]) for i, a in enumerate(arrays)
            ]
            return [await h for h in reversed(handles)][::-1]

        results = await cluster.run(many)
        for i in range(8):
            assert (results[0][i] == sum(range(4)) + 4 * i).all()


async def test_cluster_run_calls_every_rank_when_the_call_refuses_its_arguments_at_once():
    # all_reduce raises ConfigError when called (not awaited): cluster.run must still make
    # the call on every rank, or the ranks after the first fall a collective behind.
    async with open_local_cluster(3) as cluster:
        with pytest.raises(dsml.ConfigError, match="avg"):
            await cluster.run(lambda c: c.all_reduce(np.ones(3, dtype=bool), op="avg"))
        xs = [np.full(4, float(r)) for r in range(3)]
        await asyncio.wait_for(cluster.run(lambda c: c.all_reduce(xs[c.rank])), 10)
        assert [x.tolist() for x in xs] == [[3.0] * 4] * 3
