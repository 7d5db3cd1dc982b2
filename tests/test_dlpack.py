"""Arrays from other libraries in every collective: torch CPU tensors of every dtype
(contiguous and strided), JAX arrays, objects with only `__dlpack__`, memoryview and
bytearray. Each result must be bitwise equal to the numpy path's, come back as the input's
type, and in-place calls must write into the caller's memory without a copy.
"""

from __future__ import annotations

import asyncio
import sys
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

import dsml
from dsml import CommConfig, ConfigError
from dsml.testing import open_local_cluster
from tests.reference import DTYPE_NAMES, inputs

torch = pytest.importorskip("torch", reason="torch is not installed (pip install dsml[torch])")

CONFIG = CommConfig(chunk_bytes=4096, zero_copy_min_bytes=1024, timeout=30)
ROWS, COLS = 6, 5


def as_torch(a: np.ndarray):
    """A torch tensor sharing a's memory (bfloat16 through an int16 view)."""
    if a.dtype == np.dtype(ml_dtypes.bfloat16):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def as_numpy(t) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def rank_inputs(name: str, world_size: int, seed: int) -> list[np.ndarray]:
    flat = inputs(name, "sum", ROWS * COLS, world_size, seed)
    return [a.reshape(ROWS, COLS) for a in flat]


def strided(a: np.ndarray) -> np.ndarray:
    """a's values in a non-contiguous array: every other column of a wider one."""
    wide = np.zeros((a.shape[0], 2 * a.shape[1]), a.dtype)
    wide[:, ::2] = a
    return wide[:, ::2]


async def run_all(cluster, arrays, name: str) -> dict[str, list]:
    """Every collective on `arrays` (one per rank, any supported type); results by call.

    In-place calls get copies made through `copy`, so one set of inputs serves them all.
    """
    size = len(arrays)
    op = "avg" if name.startswith(("float", "bfloat", "complex")) else "sum"
    out: dict[str, list] = {}

    async def each(fn):
        return await cluster.run(lambda c: fn(c, arrays[c.rank]))

    out["all_reduce"] = await each(lambda c, x: c.all_reduce(fresh(x), op))
    out["reduce"] = await each(lambda c, x: c.reduce(fresh(x), size - 1, "sum"))
    out["broadcast"] = await each(lambda c, x: c.broadcast(fresh(x), size // 2))
    out["all_gather"] = await each(lambda c, x: c.all_gather(x))
    out["gather"] = await each(lambda c, x: c.gather(x, 0))
    out["scatter"] = await each(lambda c, x: c.scatter(x if c.rank == 0 else None, 0))
    out["reduce_scatter"] = await each(lambda c, x: c.reduce_scatter(x, "sum"))
    out["all_to_all"] = await each(lambda c, x: c.all_to_all(x))

    async def ring(c, x):
        if size == 1:
            return x
        right, left = (c.rank + 1) % size, (c.rank - 1) % size
        sent = c.send(x, right, tag=7)
        got = await c.recv(left, tag=7)
        await sent
        return got

    out["send_recv"] = await each(ring)
    return out


def fresh(x):
    """A copy of x of the same type and layout (in-place calls must not share inputs)."""
    if isinstance(x, np.ndarray):
        return x.copy() if x.flags.c_contiguous else strided(x)
    if isinstance(x, torch.Tensor):
        return x.clone() if x.is_contiguous() else as_torch(strided(as_numpy(x)))
    if isinstance(x, OnlyDLPack):
        return OnlyDLPack(x.tensor.clone())
    return x  # immutable (JAX): in-place calls leave the input alone


def to_bytes(value) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, OnlyDLPack):
        value = value.tensor
    if isinstance(value, torch.Tensor):
        value = as_numpy(value.contiguous())
    return np.ascontiguousarray(np.asarray(value)).tobytes()


def assert_same_results(expected: dict[str, list], got: dict[str, list], where: str) -> None:
    for call, results in expected.items():
        assert [to_bytes(r) for r in got[call]] == [to_bytes(r) for r in results], (
            f"{where}: {call} differs from the numpy path"
        )


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
async def test_every_collective_on_torch_tensors_of_every_dtype_matches_numpy_bitwise(
    world_size, seed
):
    async with open_local_cluster(world_size, config=CONFIG) as cluster:
        for name in DTYPE_NAMES:
            xs = rank_inputs(name, world_size, seed)
            expected = await run_all(cluster, xs, name)
            for layout in ("contiguous", "strided"):
                arrays = [as_torch(x if layout == "contiguous" else strided(x)) for x in xs]
                assert all(t.is_contiguous() == (layout == "contiguous") for t in arrays)
                got = await run_all(cluster, arrays, name)
                where = f"torch {name} {layout} world={world_size}"
                assert_same_results(expected, got, where)
                for call, results in got.items():
                    for rank, r in enumerate(results):
                        if r is not None and call not in ("send_recv", "scatter"):
                            assert isinstance(r, torch.Tensor), f"{where}: {call} rank {rank}"
                            assert r.dtype == arrays[0].dtype, f"{where}: {call}"


async def test_in_place_calls_write_into_the_callers_tensor_without_a_copy():
    async with open_local_cluster(2, config=CONFIG) as cluster:
        tensors = [torch.full((1 << 18,), float(r + 1)) for r in range(2)]  # 1 MiB each
        pointers = [t.data_ptr() for t in tensors]
        arrays = [np.full(1 << 18, float(r + 1), np.float32) for r in range(2)]
        await cluster.run(lambda c: c.all_reduce(arrays[c.rank]))  # warm the buffer pools
        await cluster.run(lambda c: c.all_reduce(tensors[c.rank].clone()))

        async def peak(values) -> int:
            tracemalloc.start()
            try:
                results = await cluster.run(lambda c: c.all_reduce(values[c.rank]))
                peak_bytes = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert all(r is v for r, v in zip(results, values, strict=True))
            return peak_bytes

        numpy_peak = await peak(arrays)
        torch_peak = await peak(tensors)
        print(f"peak traced bytes: numpy {numpy_peak}, torch {torch_peak}")
        assert [t.data_ptr() for t in tensors] == pointers
        assert all(bool((t == 3.0).all()) for t in tensors)
        # No copy of a 1 MiB tensor on the way in or out: torch costs what numpy costs.
        assert torch_peak < numpy_peak + (1 << 19)


async def test_strided_tensors_are_written_in_place_and_their_gaps_left_alone():
    async with open_local_cluster(2, config=CONFIG) as cluster:
        bases = [torch.full((4, 6), -1.0) for _ in range(2)]
        views = [b[:, ::2] for b in bases]
        for r, v in enumerate(views):
            v.fill_(r + 1.0)
        results = await cluster.run(lambda c: c.all_reduce(views[c.rank]))
        assert all(r is v for r, v in zip(results, views, strict=True))
        for base in bases:
            assert bool((base[:, ::2] == 3.0).all())
            assert bool((base[:, 1::2] == -1.0).all())


async def test_tensors_that_require_grad_are_reduced_in_place():
    async with open_local_cluster(2, config=CONFIG) as cluster:
        params = [torch.full((3,), r + 1.0, requires_grad=True) for r in range(2)]
        results = await cluster.run(lambda c: c.all_reduce(params[c.rank]))
        assert all(r is p for r, p in zip(results, params, strict=True))
        assert all(p.detach().tolist() == [3.0, 3.0, 3.0] for p in params)


async def test_torch_results_stay_torch_through_the_engine():
    async with open_local_cluster(2, config=CONFIG) as cluster:
        tensors = [torch.ones(4) * (r + 1) for r in range(2)]

        async def pushed(c):
            tagged = c.engine.tag("g", tensors[c.rank])
            result = await c.push_all_reduce(tagged)
            await c.engine.wait_all()
            return result

        results = await cluster.run(pushed)
        assert all(r is t for r, t in zip(results, tensors, strict=True))
        assert all(t.tolist() == [3.0] * 4 for t in tensors)


class OnlyDLPack:
    """Exposes nothing but the DLPack protocol (over a torch tensor)."""

    def __init__(self, tensor) -> None:
        self.tensor = tensor

    def __dlpack__(self, **kwargs):
        return self.tensor.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()


@pytest.mark.parametrize("world_size", [1, 3])
async def test_objects_with_only_dlpack_match_numpy_bitwise_and_are_written_in_place(
    world_size, seed
):
    async with open_local_cluster(world_size, config=CONFIG) as cluster:
        for name in ("int32", "float32", "bfloat16", "complex64", "bool"):
            xs = rank_inputs(name, world_size, seed)
            expected = await run_all(cluster, xs, name)
            got = await run_all(cluster, [OnlyDLPack(as_torch(x.copy())) for x in xs], name)
            assert_same_results(expected, got, f"__dlpack__-only {name}")
            assert all(isinstance(r, np.ndarray) for r in got["all_gather"])
        tensors = [torch.full((5,), float(r)) for r in range(world_size)]
        wrapped = [OnlyDLPack(t) for t in tensors]
        results = await cluster.run(lambda c: c.all_reduce(wrapped[c.rank]))
        assert all(r is w for r, w in zip(results, wrapped, strict=True))
        total = float(sum(range(world_size)))
        assert all(t.tolist() == [total] * 5 for t in tensors)


@pytest.mark.parametrize("world_size", [1, 2, 4])
async def test_jax_arrays_match_numpy_bitwise_and_are_left_untouched(world_size, seed):
    jax = pytest.importorskip("jax", reason="jax is not installed (pip install dsml[jax])")
    jnp = jax.numpy
    async with open_local_cluster(world_size, config=CONFIG) as cluster:
        for name in ("int32", "float32", "bfloat16", "complex64", "uint8", "bool"):
            xs = rank_inputs(name, world_size, seed)
            expected = await run_all(cluster, xs, name)
            arrays = [jnp.asarray(x) for x in xs]
            got = await run_all(cluster, arrays, name)
            assert_same_results(expected, got, f"jax {name}")
            for call in ("all_reduce", "broadcast", "all_gather", "reduce_scatter"):  # no input:
                # scatter's non-roots and recv give numpy arrays
                assert all(isinstance(r, jax.Array) for r in got[call]), call
            for x, a in zip(xs, arrays, strict=True):  # read-only inputs are never written
                assert np.asarray(a).tobytes() == x.tobytes()
            for r, a in zip(got["all_reduce"], arrays, strict=True):
                assert r is not a


async def test_tensors_dlpack_cannot_export_are_refused_with_the_reason():
    async with open_local_cluster(1, config=CONFIG) as cluster:
        with pytest.raises(ConfigError, match="conjugate"):
            await cluster[0].all_reduce(torch.ones(2, dtype=torch.complex64).conj())


async def test_an_object_refused_on_one_rank_fails_the_other_ranks_fast():
    patient = CommConfig(timeout=60)
    async with open_local_cluster(2, config=patient) as cluster:
        with pytest.raises(ConfigError, match="conjugate"):
            cluster[0].all_reduce(torch.ones(2, dtype=torch.complex64).conj())
        handle = cluster[1].all_reduce(torch.ones(2, dtype=torch.complex64))
        with pytest.raises(dsml.DsmlError):
            await asyncio.wait_for(handle, 10)  # not the 60 s timeout
        assert (await cluster.run(lambda c: c.all_reduce(torch.ones(2))))[0].tolist() == [2, 2]


async def attempt(call, comm):
    """call(comm) awaited (at most 10 s), or the DsmlError it raised (at once or later)."""
    try:
        return await asyncio.wait_for(call(comm), 10)
    except dsml.DsmlError as exc:
        return exc


async def test_a_negative_view_is_refused_not_read_without_its_sign():
    """DLPack exports torch's lazily negated tensors without the sign: all_gather of
    z.conj().imag gave +[2, 4], and a max all_reduce picked the wrong value."""
    async with open_local_cluster(2, config=CONFIG) as cluster:
        for call in (
            lambda c: c.all_gather(torch.tensor([1 + 2j, 3 + 4j]).conj().imag),
            lambda c: c.all_reduce(torch._neg_view(torch.full((3,), 1.0 + c.rank)), "max"),
        ):
            outcomes = await asyncio.gather(*(attempt(call, c) for c in cluster))
            assert all(isinstance(o, dsml.DsmlError) for o in outcomes), outcomes
            assert any("negative view" in str(o) for o in outcomes), outcomes
        resolved = await cluster.run(
            lambda c: c.all_gather(torch._neg_view(torch.ones(2)).resolve_neg())
        )
        assert all(r.tolist() == [-1.0] * 4 for r in resolved)


async def test_writing_into_elements_that_share_memory_is_refused_on_every_rank():
    """An expanded tensor (stride 0) took the result in some elements only: the ranks
    ended with different values ([4, 4, 4, 4] and [1, 2, 3, 4])."""
    async with open_local_cluster(2, config=CONFIG) as cluster:
        xs = [torch.tensor([1.0]).expand(4), torch.arange(4.0)]
        outcomes = await asyncio.gather(
            *(attempt(lambda c: c.all_reduce(xs[c.rank]), c) for c in cluster)
        )
        assert all(isinstance(o, dsml.DsmlError) for o in outcomes), outcomes
        assert "share memory" in str(outcomes[0])
        assert xs[1].tolist() == [0.0, 1.0, 2.0, 3.0]  # untouched
        flat = np.broadcast_to(np.ones(1), (3,))  # stride 0, and numpy lets it be written:
        flat.flags.writeable = True  # rank 0 receives into it; the root only reads it
        outcomes = await asyncio.gather(
            *(attempt(lambda c: c.broadcast(flat, root=1), c) for c in cluster)
        )
        assert isinstance(outcomes[0], ConfigError), outcomes
        assert "share memory" in str(outcomes[0])
        assert isinstance(outcomes[1], dsml.DsmlError), outcomes
        got = await cluster.run(lambda c: c.all_reduce(torch.ones(2)))  # in step still
        assert [g.tolist() for g in got] == [[2.0, 2.0]] * 2


async def test_a_jax_array_pushed_through_the_engine_is_replaced_by_its_result():
    """Readers after a push_all_reduce of an immutable array saw the old data."""
    jax = pytest.importorskip("jax", reason="jax is not installed (pip install dsml[jax])")
    async with open_local_cluster(2, config=CONFIG) as cluster:

        async def pushed(c):
            tagged = c.engine.tag("g", jax.numpy.full(3, c.rank + 1.0))
            c.push_all_reduce(tagged)
            seen = c.engine.push(lambda: np.asarray(tagged.data).tolist(), read=[tagged.var])
            return await seen

        assert await cluster.run(pushed) == [[3.0] * 3] * 2


class OnGpu(OnlyDLPack):
    """Says its memory is on CUDA device 0 (DLPack device type 2)."""

    def __dlpack_device__(self):
        return (2, 0)


async def test_a_gpu_array_without_cupy_is_refused_with_how_to_install_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` fails, as without the extra
    async with open_local_cluster(1, config=CONFIG) as cluster:
        with pytest.raises(ConfigError, match=r"GPU array .* through\s+cupy.*dsml\[gpu\]"):
            cluster[0].all_reduce(OnGpu(torch.ones(3)))


def cuda_and_cupy() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_and_cupy(), reason="needs a CUDA GPU, torch with CUDA and cupy")
async def test_torch_cuda_tensors_are_reduced_in_place_through_cupy(seed):
    async with open_local_cluster(2, config=CONFIG) as cluster:
        for name in ("float32", "int64", "float16"):
            xs = rank_inputs(name, 2, seed)
            expected = await run_all(cluster, xs, name)
            tensors = [as_torch(x).cuda() for x in xs]
            got = await run_all(cluster, tensors, name)
            assert_same_results(expected, {k: [to_cpu(r) for r in v] for k, v in got.items()}, name)
            assert all(r.is_cuda for r in got["all_gather"])
        tensors = [torch.full((5,), float(r + 1), device="cuda") for r in range(2)]
        pointers = [t.data_ptr() for t in tensors]
        results = await cluster.run(lambda c: c.all_reduce(tensors[c.rank]))
        assert all(r is t for r, t in zip(results, tensors, strict=True))
        assert [t.data_ptr() for t in tensors] == pointers
        assert all(t.cpu().tolist() == [3.0] * 5 for t in tensors)


def to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if value is not None and type(value).__module__.startswith("cupy"):
        return value.get()
    return value
