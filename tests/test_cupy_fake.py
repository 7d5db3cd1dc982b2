"""Every collective on (fake) cupy arrays, through real clusters, without a GPU.

The fake cupy of tests/fakes copies with memmove, so this runs dsml's real CUDA module
(pointers, chunked copies, events, write-back) and the communicator's device handling:
results land on the array's device, in place where numpy's are, with numpy's bytes, and
numpy and cupy ranks can be mixed. What it cannot show is timing on a real GPU
(tests/gpu/ does, where there is one).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import dsml
from dsml.testing import open_local_cluster
from tests.reference import inputs, reduce_reference, same_bytes

CONFIG = dsml.CommConfig(chunk_bytes=4096, zero_copy_min_bytes=1024, timeout=30)
COUNT = 3000  # several staging and pipeline chunks of float64


def _host(x):
    return x.get() if hasattr(x, "get") else x


@pytest.mark.parametrize("world_size", [1, 2, 3])
async def test_every_collective_on_cupy_arrays_matches_numpy(fake_cupy, world_size, seed):
    cp = fake_cupy
    xs = inputs("float64", "sum", COUNT, world_size, seed)
    async with open_local_cluster(world_size, config=CONFIG) as cluster:
        arrays = [cp.asarray(x) for x in xs]
        results = await cluster.run(lambda c: c.all_reduce(arrays[c.rank]))
        assert all(r is a for r, a in zip(results, arrays, strict=True))  # in place
        assert same_bytes([r.get() for r in results])
        np.testing.assert_array_equal(results[0].get(), reduce_reference("sum", xs))

        arrays = [cp.asarray(x) for x in xs]
        results = await cluster.run(lambda c: c.reduce(arrays[c.rank], 0, "max"))
        np.testing.assert_array_equal(results[0].get(), reduce_reference("max", xs))
        assert all(r is None for r in results[1:])

        arrays = [cp.asarray(x) for x in xs]
        results = await cluster.run(lambda c: c.broadcast(arrays[c.rank], world_size - 1))
        for r in results:
            np.testing.assert_array_equal(r.get(), xs[-1])

        results = await cluster.run(lambda c: c.all_gather(cp.asarray(xs[c.rank])))
        assert all(isinstance(r, cp.ndarray) for r in results)
        np.testing.assert_array_equal(results[0].get(), np.concatenate(xs))

        results = await cluster.run(lambda c: c.gather(cp.asarray(xs[c.rank]), 0))
        np.testing.assert_array_equal(results[0].get(), np.concatenate(xs))

        results = await cluster.run(lambda c: c.reduce_scatter(cp.asarray(xs[c.rank]), "avg"))
        expected = np.array_split(reduce_reference("avg", xs), world_size)
        for r, e in zip(results, expected, strict=True):
            np.testing.assert_array_equal(r.get(), e)

        results = await cluster.run(lambda c: c.all_to_all(cp.asarray(xs[c.rank])))
        for rank, r in enumerate(results):
            parts = [np.array_split(x, world_size)[rank] for x in xs]
            np.testing.assert_array_equal(r.get(), np.concatenate(parts))

        root_x = cp.asarray(xs[0].reshape(-1, 2))
        results = await cluster.run(lambda c: c.scatter(root_x if c.rank == 0 else None, 0))
        for rank, r in enumerate(results):
            np.testing.assert_array_equal(
                _host(r), np.array_split(xs[0].reshape(-1, 2), world_size)[rank]
            )
        assert isinstance(results[0], cp.ndarray)  # on the root's device; others: comm.device
        assert all(isinstance(r, np.ndarray) for r in results[1:])


async def test_numpy_and_cupy_ranks_mix_and_agree_bit_for_bit(fake_cupy, seed):
    cp = fake_cupy
    xs = inputs("float32", "prod", 1000, 3, seed)
    async with open_local_cluster(3, config=CONFIG) as cluster:
        for algorithm in ("ring", "tree", "naive", "direct", "mesh"):
            arrays = [cp.asarray(x) if r % 2 else x.copy() for r, x in enumerate(xs)]
            results = await cluster.run(
                lambda c: c.all_reduce(arrays[c.rank], "prod", algorithm=algorithm)
            )
            assert same_bytes([_host(r) for r in results]), algorithm
            np.testing.assert_array_equal(_host(results[1]), reduce_reference("prod", xs))
        assert isinstance(results[1], cp.ndarray)
        assert isinstance(results[0], np.ndarray)


async def test_a_strided_cupy_array_is_reduced_in_place_through_a_contiguous_copy(fake_cupy):
    cp = fake_cupy
    async with open_local_cluster(2, config=CONFIG) as cluster:
        bases = [cp.asarray(np.arange(40, dtype=np.int32).reshape(4, 10)) for _ in range(2)]
        views = [b[:, ::3] for b in bases]
        await cluster.run(lambda c: c.all_reduce(views[c.rank]))
        expected = np.arange(40, dtype=np.int32).reshape(4, 10)
        expected[:, ::3] *= 2
        for base in bases:
            np.testing.assert_array_equal(base.get(), expected)  # the gaps untouched


async def test_the_copies_wait_for_the_callers_stream_and_use_dsmls_own(fake_cupy):
    cp = fake_cupy
    async with open_local_cluster(1, config=CONFIG) as cluster:
        cp.LOG.clear()
        x = cp.asarray(np.ones(2000))
        await cluster[0].all_reduce(x)
    copies = [e for e in cp.LOG if e[0] in ("record", "wait_event", "memcpy")]
    assert copies[0] == ("record", "null")  # the caller's current stream
    assert copies[1][0] == "wait_event"
    assert copies[1][2] == "null"  # dsml's stream waits for the caller's
    dsml_stream = copies[1][1]
    assert dsml_stream != "null"
    memcpys = [e for e in copies if e[0] == "memcpy"]
    assert [e[1] for e in memcpys] == ["D2H", "D2H", "D2H", "D2H", "H2D", "H2D", "H2D", "H2D"]
    assert {e[3] for e in memcpys} == {dsml_stream}
    assert sum(e[2] for e in memcpys if e[1] == "D2H") == x.nbytes


async def test_a_failed_collective_leaves_the_cupy_input_intact(fake_cupy):
    cp = fake_cupy
    async with open_local_cluster(2, config=CONFIG) as cluster:
        arrays = [cp.asarray(np.arange(100.0)), cp.asarray(np.arange(101.0))]  # mismatched
        with pytest.raises(dsml.CollectiveMismatchError):
            await cluster.run(lambda c: c.all_reduce(arrays[c.rank]))
        np.testing.assert_array_equal(arrays[0].get(), np.arange(100.0))
        np.testing.assert_array_equal(arrays[1].get(), np.arange(101.0))


async def test_send_takes_cupy_and_recv_lands_on_comm_device(fake_cupy):
    cp = fake_cupy
    async with dsml.open_registry() as registry:
        joins = [
            dsml.init(registry.address, world_size=2, rank=r, device=d, config=CONFIG)
            for r, d in enumerate(["cpu", "cuda:0"])
        ]
        comms = await asyncio.gather(*joins)
        try:
            x = cp.asarray(np.arange(5000, dtype=np.int16))
            sent = comms[0].send(x, 1)
            got = await comms[1].recv(0)
            await sent
            assert isinstance(got, cp.ndarray)
            np.testing.assert_array_equal(got.get(), np.arange(5000, dtype=np.int16))
            back = comms[1].send(got, 0)
            host = await comms[0].recv(1)
            await back
            assert isinstance(host, np.ndarray)
        finally:
            await asyncio.gather(*(c.aclose() for c in comms))
