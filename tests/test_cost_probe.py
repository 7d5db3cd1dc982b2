"""Measuring a group for the cost model: every rank ends with rank 0's fit.

The group here is in memory, with links that delay each message by a latency plus a time
per byte, so the fit can be checked against what the links were given (loosely: the
machine running the tests is shared and asyncio timers overshoot under load).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from dsml.collectives.cost import CostModel
from dsml.collectives.cost_probe import measure_cost, round_order
from dsml.collectives.group import Lane, Received
from dsml.errors import ProtocolError

MiB = 1 << 20


class _Done:
    def done(self) -> bool:
        return True

    async def wait(self) -> None:
        return None


class DelayLinks:
    """Queues between ranks. A link sends one message at a time, nbytes * per_byte_s
    each, and a message arrives latency_s after it has been sent."""

    def __init__(self, size: int, latency_s: float, per_byte_s: float) -> None:
        self.size = size
        self.latency_s, self.per_byte_s = latency_s, per_byte_s
        self.queues: dict[tuple[int, int], asyncio.Queue[Any]] = {
            (a, b): asyncio.Queue() for a in range(size) for b in range(size)
        }
        self.busy_until: dict[tuple[int, int], float] = {}
        self.last_arrival: dict[tuple[int, int], float] = {}

    def deliver(self, src: int, dst: int, item: Any, nbytes: int) -> None:
        loop = asyncio.get_running_loop()
        link = (src, dst)
        sent = max(loop.time(), self.busy_until.get(link, 0.0)) + nbytes * self.per_byte_s
        self.busy_until[link] = sent
        # timers due at one instant may fire in any order: keep every link FIFO
        at = max(sent + self.latency_s, self.last_arrival.get(link, 0.0) + 1e-6)
        self.last_arrival[link] = at
        loop.call_at(at, self.queues[link].put_nowait, item)


class MemoryGroup:
    """A `Group` over `DelayLinks` (payloads are copied, as a network would)."""

    chunk_bytes = MiB

    def __init__(self, links: DelayLinks, rank: int) -> None:
        self.links, self.rank, self.size = links, rank, links.size

    async def send(
        self,
        peer: int,
        step: int,
        chunk: int = 0,
        payload: memoryview | None = None,
        *,
        meta: dict[str, Any] | None = None,
        lane: Lane = Lane.DATA,
    ) -> _Done:
        data = bytes(payload) if payload is not None else b""
        self.links.deliver(self.rank, peer, (step, chunk, data, meta), len(data))
        return _Done()

    async def recv(
        self,
        peer: int,
        step: int,
        chunk: int = 0,
        *,
        nbytes: int | None = None,
        lane: Lane = Lane.DATA,
    ) -> Received:
        got_step, got_chunk, data, meta = await self.links.queues[(peer, self.rank)].get()
        assert (got_step, got_chunk) == (step, chunk), "the probe's messages arrived out of order"
        assert nbytes is None or len(data) == nbytes
        return Received(memoryview(data), meta)


async def probe(
    size: int, latency_s: float = 0.0, per_byte_s: float = 0.0, hosts: list[str] | None = None
) -> list[CostModel]:
    links = DelayLinks(size, latency_s, per_byte_s)
    keys = hosts or [f"host{r}" for r in range(size)]
    return await asyncio.gather(
        *(
            measure_cost(
                MemoryGroup(links, r), keys, default_chunk_bytes=MiB, max_chunk_bytes=64 * MiB
            )
            for r in range(size)
        )
    )


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
async def test_every_rank_ends_with_the_same_model(size: int) -> None:
    models = await probe(size)
    assert all(m == models[0] for m in models)
    assert models[0].world_size == size
    assert models[0].hosts == size


async def test_ranks_sharing_a_host_are_counted_in_the_model() -> None:
    models = await probe(4, hosts=["a", "a", "b", "b"])
    assert (models[0].hosts, models[0].ranks_per_host) == (2, 2)


async def test_the_fit_finds_the_latency_and_per_byte_time_the_links_have() -> None:
    latency, per_byte = 2e-3, 20e-9  # 2 ms, 50 MB/s: large enough to stand above the noise
    m = (await probe(3, latency, per_byte))[0]
    assert latency * 0.8 < m.alpha_s < latency * 3
    assert per_byte * 0.8 < m.beta_s < per_byte * 3
    assert m.gamma_s > 0


async def test_slow_links_make_the_model_choose_differently_than_fast_ones() -> None:
    fast = (await probe(4, 0.0, 0.0))[0]
    slow = (await probe(4, 5e-3, 0.0))[0]
    assert slow.alpha_s > 5 * fast.alpha_s
    assert slow.predict("ring", 4096, MiB) > slow.predict("direct", 4096, MiB)


async def test_a_malformed_model_from_rank_0_is_a_protocol_error() -> None:
    links = DelayLinks(2, 0.0, 0.0)
    real_send = MemoryGroup.send

    async def forge(
        self: MemoryGroup, peer: int, step: int, chunk: int = 0, payload: Any = None, **kw: Any
    ) -> _Done:
        if kw.get("meta") is not None and "alpha_s" in kw["meta"]:
            kw["meta"] = {**kw["meta"], "alpha_s": "soon"}
        return await real_send(self, peer, step, chunk, payload, **kw)

    rank0 = MemoryGroup(links, 0)
    rank0.send = forge.__get__(rank0)  # type: ignore[method-assign]
    results = await asyncio.gather(
        measure_cost(rank0, ["a", "b"], default_chunk_bytes=MiB, max_chunk_bytes=MiB),
        measure_cost(
            MemoryGroup(links, 1), ["a", "b"], default_chunk_bytes=MiB, max_chunk_bytes=MiB
        ),
        return_exceptions=True,
    )
    assert isinstance(results[0], CostModel)
    assert isinstance(results[1], ProtocolError)


def test_the_race_order_is_a_fixed_permutation_that_varies_which_algorithm_follows_which() -> None:
    """Every rank must time the algorithms in the same order (the calls are collectives),
    and over a race's rounds each algorithm should follow several others, not always the
    same one (whose leftovers, an emptied shaper bucket, it would pay for)."""
    orders = [round_order(i, 5) for i in range(8)]
    assert orders == [round_order(i, 5) for i in range(8)]  # fixed: no hidden state
    assert all(sorted(o) == list(range(5)) for o in orders)
    assert len({tuple(o) for o in orders}) >= 6
    for name in range(5):
        before = {o[o.index(name) - 1] for o in orders if o.index(name) > 0}
        assert len(before) >= 2, (name, orders)
    assert round_order(0, 1) == [0]
    assert round_order(3, 0) == []
