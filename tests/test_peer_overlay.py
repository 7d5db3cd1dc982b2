"""Peer watch along a fixed overlay (each member watches OVERLAY_K ring successors and as
many predecessors): beats per member independent of the group's size, and the loss rules
(partitions without the registry, a rank cut off while the registry is up) kept in views
larger than the overlay, in-process over real sockets."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

import dsml
from dsml import CommConfig, EvictedError, MembershipChangedError, NoQuorumError, RegistryConfig
from dsml.membership.peerwatch import OVERLAY_K, PeerWatch, overlay
from dsml.testing import Faults, crash, inject, open_local_cluster
from tests.test_membership_hardening_cluster import exact_call, partition, until_size
from tests.waiting import eventually

# slower than the hardening tests' beats: ten or more ranks share this loop
HB = RegistryConfig(heartbeat_interval=0.1, heartbeat_timeout=1.0)
CONFIG = CommConfig(timeout=15, view_timeout=15, join_timeout=20, registry_timeout=3)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7, 8, 10, 64, 1024])
def test_the_overlay_is_symmetric_and_its_size_does_not_grow_with_the_view(size: int) -> None:
    for rank in range(size):
        peers = overlay(size, rank)
        assert rank not in peers
        assert len(set(peers)) == len(peers) == min(size - 1, 2 * OVERLAY_K)
        assert all(rank in overlay(size, peer) for peer in peers)
    if size <= 2 * OVERLAY_K + 1:
        assert sorted(overlay(size, 0)) == list(range(1, size))


def test_a_peer_watched_on_demand_is_due_a_beat_and_silent_after_a_timeout() -> None:
    watch = PeerWatch(interval=1.0, timeout=10.0)
    watch.reset(["a"], now=0.0)
    assert watch.add(["a", "b"], now=5.0) == ["b"]
    assert watch.due(5.0) == ["a", "b"]
    assert watch.silent(14.0) == ["a"]  # b: a full timeout from when it was added
    assert watch.silent(15.5) == ["a", "b"]
    watch.reset(["a"], now=20.0)
    assert not watch.watches("b")


class Recorder(Faults):
    """Faults that drop nothing and remember to whom messages went."""

    def __init__(self) -> None:
        super().__init__()
        self.targets: set[str] = set()

    def decide(self, member_id: str) -> str:
        self.targets.add(member_id)
        return super().decide(member_id)


@pytest.mark.timeout(90)
async def test_an_idle_rank_of_10_beats_its_overlay_neighbours_and_no_one_else() -> None:
    async with open_local_cluster(10, config=CONFIG, registry_config=HB) as cluster:
        await cluster.run(exact_call)
        recorders = [Recorder() for _ in cluster]
        for comm, recorder in zip(cluster, recorders, strict=True):
            inject(comm, recorder)
        neighbours = [
            {c.view.members[p].id for p in overlay(c.world_size, c.rank)} for c in cluster
        ]
        assert all(len(n) == 2 * OVERLAY_K for n in neighbours)

        def all_beaten() -> bool:
            return all(r.targets >= n for r, n in zip(recorders, neighbours, strict=True))

        await eventually(all_beaten, "every rank beat all its neighbours", within=30)
        for comm, recorder, near in zip(cluster, recorders, neighbours, strict=True):
            assert recorder.targets == near, (comm.rank, sorted(recorder.targets - near))


@pytest.mark.timeout(120)
async def test_a_7_plus_3_partition_without_registry_leaves_the_7_as_one_group() -> None:
    """Most of the 7 watch none of the 3: they agree once they watched the 3 on demand."""
    async with open_local_cluster(10, config=CONFIG, registry_config=HB) as cluster:
        await cluster.run(exact_call)
        await cluster.registry.aclose()
        majority, minority = list(range(7)), [7, 8, 9]
        partition(cluster, [majority, minority])

        async def until_no_quorum(comm: dsml.Communicator) -> list[BaseException]:
            errors: list[BaseException] = []
            while not any(isinstance(e, NoQuorumError) for e in errors):
                try:
                    await exact_call(comm)
                except MembershipChangedError as exc:
                    errors.append(exc)
            return errors

        results = await asyncio.gather(
            *(until_size(cluster[r], 7) for r in majority),
            *(until_no_quorum(cluster[r]) for r in minority),
        )
        assert all(len(e) <= 1 for e in results[:7]), results[:7]
        views = {(c.epoch, tuple(m.id for m in c.view.members)) for c in cluster.comms[:7]}
        assert len(views) == 1


@pytest.mark.timeout(120)
async def test_a_rank_cut_off_from_a_view_of_14_is_dropped_on_its_watchers_reports() -> None:
    """Only its 6 overlay neighbours watch it: their reports, not most of the 13 others,
    are what the registry needs (the registry still hears the cut-off rank)."""
    config = dataclasses.replace(CONFIG, timeout=30)
    async with open_local_cluster(14, config=config, registry_config=HB) as cluster:
        await cluster.run(exact_call)
        others = list(range(13))
        partition(cluster, [others, [13]])
        lone = cluster[13]
        pending = asyncio.ensure_future(exact_call(lone))
        results = await asyncio.gather(*(until_size(cluster[r], 13) for r in others))
        with pytest.raises(EvictedError):
            await pending
        assert all(len(e) <= 2 for e in results), results
        await eventually(lambda: lone.evicted, "the cut-off rank told it was dropped", within=10)


@pytest.mark.timeout(120)
async def test_a_crashed_rank_of_10_is_seen_by_every_survivor_not_only_its_watchers() -> None:
    """A killed process's connections drop: every survivor sees it on its own link, so the
    call in flight fails on all nine (most of which do not watch rank 0) and they go on."""
    async with open_local_cluster(10, config=CONFIG, registry_config=HB) as cluster:
        await cluster.run(exact_call)
        survivors = list(range(1, 10))
        assert any(0 not in overlay(10, r) for r in survivors)
        pending = [asyncio.ensure_future(exact_call(cluster[r])) for r in survivors]
        await asyncio.sleep(0)
        await crash(cluster[0])
        outcomes = await asyncio.gather(*pending, return_exceptions=True)
        assert all(isinstance(o, MembershipChangedError) for o in outcomes), outcomes
        results = await asyncio.gather(*(until_size(cluster[r], 9) for r in survivors))
        assert all(len(e) <= 1 for e in results), results
