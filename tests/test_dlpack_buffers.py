"""Buffer-protocol objects (memoryview, bytearray, bytes) in collectives, and what is
refused; none of this needs torch or JAX."""

from __future__ import annotations

import array
import asyncio
import subprocess
import sys

import numpy as np
import pytest

from dsml import CommConfig, ConfigError, DsmlError
from dsml.testing import open_local_cluster

CONFIG = CommConfig(chunk_bytes=4096, zero_copy_min_bytes=1024, timeout=30)


async def test_memoryview_and_bytearray_are_reduced_in_place_and_keep_their_type():
    async with open_local_cluster(2, config=CONFIG) as cluster:
        views = [memoryview(np.arange(6, dtype=np.int32) * (r + 1)) for r in range(2)]
        results = await cluster.run(lambda c: c.all_reduce(views[c.rank]))
        assert all(r is v for r, v in zip(results, views, strict=True))
        assert [list(v) for v in views] == [[0, 3, 6, 9, 12, 15]] * 2
        gathered = await cluster.run(lambda c: c.all_gather(views[c.rank]))
        assert all(isinstance(g, memoryview) and g.format == "i" for g in gathered)
        assert list(gathered[0]) == [0, 3, 6, 9, 12, 15] * 2

        buffers = [bytearray([1, 2, 3]), bytearray([10, 20, 30])]
        results = await cluster.run(lambda c: c.all_reduce(buffers[c.rank], "max"))
        assert all(r is b for r, b in zip(results, buffers, strict=True))
        assert buffers == [bytearray([10, 20, 30])] * 2
        gathered = await cluster.run(lambda c: c.all_gather(buffers[c.rank]))
        assert gathered == [bytearray([10, 20, 30] * 2)] * 2

        read_only = [memoryview(b"\x01\x02"), memoryview(b"\x05\x06")]
        results = await cluster.run(lambda c: c.all_reduce(read_only[c.rank]))
        assert [bytes(r) for r in results] == [b"\x06\x08"] * 2
        assert [bytes(v) for v in read_only] == [b"\x01\x02", b"\x05\x06"]  # untouched

        frozen = [b"\x01\x02", b"\x03\x04"]
        results = await cluster.run(lambda c: c.all_reduce(frozen[c.rank]))
        assert results == [b"\x04\x06"] * 2
        assert frozen == [b"\x01\x02", b"\x03\x04"]


async def test_objects_that_are_not_arrays_are_refused_with_a_clear_error():
    async with open_local_cluster(1, config=CONFIG) as cluster:
        with pytest.raises(ConfigError, match="__dlpack__ or the buffer protocol"):
            cluster[0].all_reduce([1, 2, 3])


async def attempt(comm, x):
    """comm.all_reduce(x) awaited (at most 10 s), or the DsmlError it raised."""
    try:
        return await asyncio.wait_for(comm.all_reduce(x), 10)
    except DsmlError as exc:
        return exc


async def test_signed_bytes_stay_signed_and_odd_buffers_are_read_or_refused_in_turn():
    """array('b') and int8 memoryviews were read as uint8 (max of -1 and 1 gave -1); a
    buffer numpy could not read raised BufferError or ValueError before the call took its
    turn, so the peers paired each later call with the previous one."""
    async with open_local_cluster(2, config=CONFIG) as cluster:
        signed = [array.array("b", [-1, 5, -100]), array.array("b", [1, -5, 100])]
        await cluster.run(lambda c: c.all_reduce(signed[c.rank], "max"))
        assert [list(x) for x in signed] == [[1, 5, 100]] * 2
        views = [memoryview(np.array([-1, 5], np.int8)), memoryview(np.array([1, -5], np.int8))]
        await cluster.run(lambda c: c.all_reduce(views[c.rank], "min"))
        assert [v.tolist() for v in views] == [[-1, -5]] * 2

        empty = [np.zeros((0, 3)), np.zeros((3, 0), np.float32)]  # strides (0, 0): not shared
        for x in empty:
            got = await cluster.run(lambda c, x=x: c.all_reduce(x.copy()))
            assert all(g.shape == x.shape for g in got)
        strided = [memoryview(bytearray(range(8)))[::2], memoryview(bytearray(range(8)))[::2]]
        await cluster.run(lambda c: c.all_reduce(strided[c.rank]))
        assert [list(v) for v in strided] == [[0, 4, 8, 12]] * 2

        released = memoryview(bytearray(4))
        released.release()
        mine = [released, np.ones(4, np.uint8)]
        outcomes = await asyncio.gather(*(attempt(c, mine[c.rank]) for c in cluster))
        assert isinstance(outcomes[0], ConfigError), outcomes
        assert isinstance(outcomes[1], DsmlError), outcomes  # at once, not at the timeout
        xs = [np.full(4, 10, np.uint8), np.full(4, 20, np.uint8)]
        await cluster.run(lambda c: c.all_reduce(xs[c.rank]))  # the next call pairs
        assert [x.tolist() for x in xs] == [[30] * 4] * 2


def test_importing_dsml_and_its_blocking_api_imports_neither_torch_nor_jax():
    code = "import dsml, dsml.blocking, sys; print('torch' in sys.modules, 'jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
