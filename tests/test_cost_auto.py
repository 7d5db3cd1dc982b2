"""`auto` across hosts: the first auto call of a view measures it, every rank agrees.

Ranks that bind different loopback addresses (127.0.0.1, .2, ...) count as different
hosts, so the cost model is measured here over real sockets on one machine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

import dsml
from dsml.collectives import choose_all_reduce
from dsml.config import CommConfig
from dsml.testing import open_local_cluster

KiB, MiB = 1024, 1 << 20


@pytest.fixture
async def hosts3() -> AsyncIterator[list[dsml.Communicator]]:
    """Three ranks, each on its own loopback address (three "hosts")."""
    async with dsml.open_registry("tcp://127.0.0.1:0") as registry:
        joins = [
            dsml.init(
                registry.address,
                world_size=3,
                rank=r,
                config=CommConfig(bind=f"tcp://127.0.0.{r + 1}:0", chunk_bytes=64 * KiB),
            )
            for r in range(3)
        ]
        comms = list(await asyncio.gather(*joins))
        try:
            yield comms
        finally:
            await asyncio.gather(*(c.aclose() for c in comms))


def ramp(rank: int, count: int) -> np.ndarray:
    return (np.arange(count) % 1000 + rank).astype(np.float32)


def expected(size: int, count: int) -> np.ndarray:
    return sum(ramp(r, count) for r in range(size))  # type: ignore[return-value]


async def test_first_auto_call_across_hosts_measures_and_every_rank_holds_the_same_model(
    hosts3: list[dsml.Communicator],
) -> None:
    assert all(c.cost_model is None for c in hosts3)
    xs = [ramp(c.rank, 1000) for c in hosts3]
    await asyncio.gather(*(c.all_reduce(x) for c, x in zip(hosts3, xs, strict=True)))
    for x in xs:
        np.testing.assert_array_equal(x, expected(3, 1000))
    models = [c.cost_model for c in hosts3]
    assert models[0] is not None
    assert all(m == models[0] for m in models)
    assert (models[0].world_size, models[0].hosts, models[0].ranks_per_host) == (3, 3, 1)


@pytest.mark.parametrize("count", [0, 1, 1000, 300_000])
async def test_auto_across_hosts_gives_bitwise_identical_results_at_every_size(
    hosts3: list[dsml.Communicator], count: int
) -> None:
    for _ in range(2):  # the measuring call, then one that only chooses
        xs = [ramp(c.rank, count) for c in hosts3]
        await asyncio.gather(*(c.all_reduce(x) for c, x in zip(hosts3, xs, strict=True)))
        for x in xs:
            np.testing.assert_array_equal(x, expected(3, count))


async def test_every_rank_chooses_the_same_algorithm_and_chunk_at_every_size(
    hosts3: list[dsml.Communicator],
) -> None:
    await asyncio.gather(*(c.all_reduce(np.ones(8, np.float32)) for c in hosts3))
    for nbytes in (4 * KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB):
        choices = {c.all_reduce_choice(nbytes) for c in hosts3}
        assert len(choices) == 1
        (choice,) = choices
        model = hosts3[0].cost_model
        assert model is not None
        assert choice == model.choose(nbytes)


async def test_auto_calls_started_together_agree_on_which_one_measures(
    hosts3: list[dsml.Communicator],
) -> None:
    arrays = {c.rank: [ramp(c.rank, n) for n in (10, 70_000, 5)] for c in hosts3}

    async def calls(c: dsml.Communicator) -> None:
        await asyncio.gather(*(c.all_reduce(x) for x in arrays[c.rank]))  # handles overlap

    await asyncio.gather(*(calls(c) for c in hosts3))
    for xs in arrays.values():
        for x in xs:
            np.testing.assert_array_equal(x, expected(3, len(x)))


async def test_an_explicit_algorithm_across_hosts_does_not_measure(
    hosts3: list[dsml.Communicator],
) -> None:
    await asyncio.gather(*(c.all_reduce(np.ones(8), algorithm="ring") for c in hosts3))
    assert all(c.cost_model is None for c in hosts3)


async def test_a_single_host_group_keeps_the_size_table_and_measures_nothing() -> None:
    async with open_local_cluster(3) as cluster:
        await cluster.run(lambda c: c.all_reduce(np.ones(1000, np.float32)))
        for comm in cluster:
            assert comm.cost_model is None
            for nbytes in (4 * KiB, MiB, 64 * MiB):
                assert comm.all_reduce_choice(nbytes).algorithm == choose_all_reduce(nbytes, 3)


async def test_a_new_view_is_measured_again(hosts3: list[dsml.Communicator]) -> None:
    await asyncio.gather(*(c.all_reduce(np.ones(8)) for c in hosts3))
    assert all(c.cost_model is not None and c.cost_model.world_size == 3 for c in hosts3)
    waiting = [asyncio.ensure_future(c.wait_view_change(timeout=30)) for c in hosts3]
    config = CommConfig(bind="tcp://127.0.0.4:0")
    async with dsml.init(hosts3[0].registry_address, config=config) as joiner:
        await asyncio.gather(*waiting)
        comms = [*hosts3, joiner]
        xs = [np.ones(8) for _ in comms]
        await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs, strict=True)))
        for c, x in zip(comms, xs, strict=True):
            np.testing.assert_array_equal(x, np.full(8, 4.0))
            assert c.cost_model is not None
            assert (c.cost_model.world_size, c.cost_model.hosts) == (4, 4)
        await asyncio.gather(*(c.barrier() for c in comms))


async def test_frames_capped_below_the_probes_messages_keep_the_size_table() -> None:
    async with dsml.open_registry("tcp://127.0.0.1:0") as registry:
        small = {"chunk_bytes": 64 * KiB, "max_frame_bytes": 256 * KiB}
        joins = [
            dsml.init(
                registry.address,
                world_size=2,
                rank=r,
                config=CommConfig(bind=f"tcp://127.0.0.{r + 1}:0", **small),  # type: ignore[arg-type]
            )
            for r in range(2)
        ]
        comms = list(await asyncio.gather(*joins))
        try:
            xs = [ramp(c.rank, 100_000) for c in comms]
            await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs, strict=True)))
            for c, x in zip(comms, xs, strict=True):
                np.testing.assert_array_equal(x, expected(2, 100_000))
                assert c.cost_model is None
        finally:
            await asyncio.gather(*(c.aclose() for c in comms))


def test_choices_from_a_model_are_remembered_per_size_until_the_model_changes() -> None:
    from dsml.collectives.cost import CostModel
    from dsml.collectives.cost_auto import AutoChooser

    chooser = AutoChooser(
        lambda: 1, lambda: ["a", "b"], default_chunk_bytes=MiB, max_chunk_bytes=MiB
    )
    first = CostModel(2, 2, 1, 1e-4, 8e-9, 8e-9, 1e-5, 1e-10, raced=(("naive", 4096, 1e-4),))
    second = CostModel(2, 2, 1, 1e-4, 8e-9, 8e-9, 1e-5, 1e-10, raced=(("tree", 4096, 1e-5),))
    assert chooser.choose(first, 4096) is chooser.choose(first, 4096)
    assert chooser.choose(first, 4096) == first.choose(4096)
    assert chooser.choose(second, 4096) == second.choose(4096) != first.choose(4096)


async def test_the_chunks_auto_may_choose_stay_within_the_smallest_frame_of_the_view() -> None:
    """A member accepting smaller frames than this rank (its max_frame_bytes, in the view)
    bounds the model's chunks, read once per view; below the probe's frames, the size
    table decides (every rank alike: the bound comes from the view)."""
    from dsml.collectives.cost_auto import AutoChooser
    from dsml.collectives.cost_probe import PROBE_FRAME_BYTES
    from dsml.communicator.session import frame_limit
    from dsml.membership import Member, View

    def view(epoch: int, *frames: int) -> View:
        members = tuple(
            Member(f"m{i}", f"tcp://10.0.0.{i}:1", max_frame=f) for i, f in enumerate(frames)
        )
        return View(epoch, members)

    current = [view(1, 64 * MiB, 8 * MiB)]
    assert frame_limit(current[0]) == 8 * MiB
    assert frame_limit(view(1, 0, 0)) == 0  # members that did not say: no bound
    chooser = AutoChooser(
        lambda: current[0].epoch,
        lambda: ["a", "b"],
        default_chunk_bytes=4 * MiB,
        max_chunk_bytes=64 * MiB,
        frame_limit=lambda: frame_limit(current[0]),
    )
    assert chooser.ticket() is not None
    assert chooser._chunks["max_chunk_bytes"] == 8 * MiB
    current[0] = view(2, 64 * MiB, PROBE_FRAME_BYTES // 2)
    assert chooser.ticket() is None
