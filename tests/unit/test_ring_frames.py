"""The ring's own-segment sums written over received frames (all_reduce_ring.py).

Over ZeroMQ a received frame is writable, and the ring writes its final sums over it; the
in-memory network hands out read-only bytes, which take the path through `work`. Both must
give the same bits on every rank, for every op, dtype and awkward length, and a rank dying
mid-call must leave every survivor's input intact.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dsml.collectives import ALL_REDUCE, NUMPY, check_op
from dsml.collectives.group import Received
from dsml.errors import PeerLostError
from dsml.testing import MemoryNetwork

CHUNK = 64  # bytes: many pipeline chunks per segment


class WritableFrames:
    """A group whose received payloads are writable, as ZeroMQ's frames are."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.rank, self.size, self.chunk_bytes = inner.rank, inner.size, inner.chunk_bytes
        self.send = inner.send

    async def recv(self, *args: Any, **kwargs: Any) -> Received:
        got = await self._inner.recv(*args, **kwargs)
        return Received(memoryview(bytearray(got.payload)), got.meta)


def inputs(size: int, count: int, dtype: str) -> list[np.ndarray]:
    rng = np.random.default_rng(count * 10 + size)
    return [(rng.standard_normal(count) * 100).astype(dtype) + rank for rank in range(size)]


async def ring(size: int, xs: list[np.ndarray], op: str, writable: bool) -> list[Any]:
    async def run(g: Any) -> np.ndarray:
        src = xs[g.rank].copy()
        group = WritableFrames(g) if writable else g
        reduce_op = check_op(op, str(src.dtype))
        await ALL_REDUCE["ring"](group, NUMPY, src, np.empty_like(src), src, reduce_op)
        return src

    return await MemoryNetwork(size, chunk_bytes=CHUNK).run(run)


@pytest.mark.parametrize("size", [2, 3, 5])
@pytest.mark.parametrize(
    ("dtype", "op"),
    [
        (dtype, op)
        for dtype in ("float32", "float64", "int64")
        for op in ("sum", "avg", "prod", "min", "max")
        if not (op == "avg" and dtype == "int64")  # avg is for floating types
    ],
)
async def test_sums_over_frames_match_sums_in_work_bit_for_bit(size, dtype, op):
    for count in (0, 1, size - 1, 101):
        xs = inputs(size, count, dtype)
        in_frames = await ring(size, xs, op, writable=True)
        in_work = await ring(size, xs, op, writable=False)
        for rank in range(size):
            assert isinstance(in_frames[rank], np.ndarray), in_frames[rank]
            assert in_frames[rank].tobytes() == in_frames[0].tobytes(), f"rank {rank}"
            assert in_frames[rank].tobytes() == in_work[rank].tobytes(), f"rank {rank}"
        if dtype == "int64" and op == "sum":
            np.testing.assert_array_equal(in_frames[0], sum(xs))


@pytest.mark.parametrize("after_sends", [1, 3, 6])
async def test_a_rank_dying_leaves_every_input_intact_with_frames_written(after_sends):
    size = 4
    net = MemoryNetwork(size, chunk_bytes=CHUNK)
    net.kill(2, after_sends=after_sends)
    xs = inputs(size, 100, "float32")
    originals = [x.copy() for x in xs]

    async def run(g: Any) -> np.ndarray:
        src = xs[g.rank]  # in place: the result would overwrite the input
        op = check_op("sum", "float32")
        await ALL_REDUCE["ring"](WritableFrames(g), NUMPY, src, np.empty_like(src), src, op)
        return src

    outcomes = await net.run(run, timeout=5.0)
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, PeerLostError), f"rank {rank}: {outcome!r}"
    for x, original in zip(xs, originals, strict=True):
        assert x.tobytes() == original.tobytes()
