"""Collectives on real cupy arrays (needs cupy and a CUDA GPU; skipped otherwise).

World sizes 1-4 share one GPU in one process (open_local_cluster). Inputs are
integer-valued, so results must equal numpy's exactly in any order. Both places of
reduction are covered (`CommConfig.gpu_reduce`). All of them passed on an H100 on
2026-11-28 (docs/operations.md); CI has no GPU, so there they are skipped.
"""

from __future__ import annotations

import numpy as np
import pytest

import dsml
from dsml.testing import open_local_cluster
from tests.reference import DTYPE_NAMES, OPS, inputs, reduce_reference, same_bytes, valid

cupy = pytest.importorskip("cupy", reason='cupy is not installed (pip install "dsml[gpu]")')


def _gpu_count() -> int:
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_gpu_count() == 0, reason="no CUDA GPU visible"),
]

CUPY_DTYPES = [name for name in DTYPE_NAMES if name != "bfloat16"]  # cupy has no bfloat16
MODES = ["host", "device"]


def config(mode: str) -> dsml.CommConfig:
    return dsml.CommConfig(chunk_bytes=4096, zero_copy_min_bytes=1024, timeout=60, gpu_reduce=mode)


def on_gpu(xs: list[np.ndarray]) -> list:
    return [cupy.asarray(x) for x in xs]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CUPY_DTYPES)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
async def test_all_reduce_on_cupy_matches_numpy_in_place(world_size, name, mode, seed):
    async with open_local_cluster(world_size, config=config(mode)) as cluster:
        for op in filter(lambda o: valid(o, name), OPS):
            for algorithm in ("ring", "tree", "naive", "direct", "mesh", "auto"):
                for count in (0, 1, world_size + 1, 5000):
                    xs = inputs(name, op, count, world_size, seed + count)
                    arrays = on_gpu(xs)
                    results = await cluster.run(
                        lambda c: c.all_reduce(arrays[c.rank], op, algorithm=algorithm)
                    )
                    where = f"{op} {algorithm} count={count}"
                    assert all(r is a for r, a in zip(results, arrays, strict=True)), where
                    host = [r.get() for r in results]
                    assert same_bytes(host), where
                    np.testing.assert_array_equal(host[0], reduce_reference(op, xs), where)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
async def test_every_other_collective_on_cupy_lands_on_the_gpu(world_size, mode, seed):
    xs = inputs("int32", "sum", 3000, world_size, seed)
    async with open_local_cluster(world_size, config=config(mode)) as cluster:
        arrays = on_gpu(xs)
        results = await cluster.run(lambda c: c.reduce(arrays[c.rank], 0, "sum"))
        np.testing.assert_array_equal(results[0].get(), reduce_reference("sum", xs))
        for rank in range(1, world_size):
            assert results[rank] is None
            np.testing.assert_array_equal(arrays[rank].get(), xs[rank])

        arrays = on_gpu(xs)
        results = await cluster.run(lambda c: c.broadcast(arrays[c.rank], 0))
        assert all(r is a for r, a in zip(results, arrays, strict=True))
        for r in results:
            np.testing.assert_array_equal(r.get(), xs[0])

        for verb, expected in [
            ("all_gather", lambda rank: np.concatenate(xs)),
            ("reduce_scatter", lambda rank: np.array_split(sum(xs), world_size)[rank]),
            (
                "all_to_all",
                lambda rank: np.concatenate([np.array_split(x, world_size)[rank] for x in xs]),
            ),
        ]:
            results = await cluster.run(lambda c: getattr(c, verb)(cupy.asarray(xs[c.rank])))
            for rank, r in enumerate(results):
                assert isinstance(r, cupy.ndarray), verb
                np.testing.assert_array_equal(r.get(), expected(rank), verb)

        results = await cluster.run(lambda c: c.gather(cupy.asarray(xs[c.rank]), 0))
        np.testing.assert_array_equal(results[0].get(), np.concatenate(xs))

        root_x = cupy.asarray(xs[0])
        results = await cluster.run(lambda c: c.scatter(root_x if c.rank == 0 else None, 0))
        assert isinstance(results[0], cupy.ndarray)
        for rank, r in enumerate(results):
            got = r.get() if isinstance(r, cupy.ndarray) else r
            np.testing.assert_array_equal(got, np.array_split(xs[0], world_size)[rank])


SLOW_FILL = r"""
extern "C" __global__ void slow_fill(double* x, int n, double value, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = value;
}
"""


@pytest.mark.parametrize("mode", MODES)
async def test_a_kernel_still_running_on_the_callers_stream_is_waited_for(mode):
    kernel = cupy.RawKernel(SLOW_FILL, "slow_fill")
    n = 1 << 20
    async with open_local_cluster(2, config=config(mode)) as cluster:
        arrays = [cupy.zeros(n, dtype=cupy.float64) for _ in range(2)]
        cupy.cuda.Device().synchronize()
        stream = cupy.cuda.Stream(non_blocking=True)  # no implicit sync with anything
        with stream:
            for rank, x in enumerate(arrays):  # ~0.2 s each at 1-2 GHz
                kernel(((n + 255) // 256,), (256,), (x, np.int32(n), float(rank + 1), 300_000_000))
            handles = [cluster[r].all_reduce(arrays[r]) for r in range(2)]  # at once
        results = [await h for h in handles]
        for r in results:
            np.testing.assert_array_equal(r.get(), np.full(n, 3.0))


async def test_numpy_and_cupy_ranks_mix(seed):
    xs = inputs("float32", "sum", 4000, 2, seed)
    async with open_local_cluster(2, config=config("host")) as cluster:
        arrays = [xs[0].copy(), cupy.asarray(xs[1])]
        results = await cluster.run(lambda c: c.all_reduce(arrays[c.rank]))
        assert isinstance(results[0], np.ndarray)
        assert results[0].tobytes() == results[1].get().tobytes()


async def test_init_with_cuda_places_the_communicator_on_a_gpu():
    async with (
        dsml.open_registry() as registry,
        dsml.init(registry.address, world_size=1, device="cuda") as comm,
    ):
        assert comm.device == "cuda:0"
        assert cupy.cuda.Device().id == 0
