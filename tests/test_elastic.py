"""dsml.elastic: State, sync, and run() through losses and joins, against a fault-free run."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import dsml
from dsml import CommConfig, ConfigError
from dsml.elastic import BelowMinSizeError, State
from dsml.testing import crash, open_local_cluster
from tests.waiting import eventually

PATIENT = CommConfig(timeout=30, join_timeout=10)
MOD = 1_000_003
ITEMS = 24  # items of the global batch, shared out by rank


def contribution(params: np.ndarray, step: int, rank: int, size: int) -> np.ndarray:
    """This rank's share of the step's update: exact integers, so the sum over any split
    of the items is the same (no rounding depends on the world size)."""
    out = np.zeros_like(params)
    for item in range(rank, ITEMS, size):
        out += (params * (item + 1) + step * 7 + item) % 101
    return out


def reference(steps: int) -> list[np.ndarray]:
    """The parameters after each step, computed in one process without faults."""
    params = np.arange(8, dtype=np.int64)
    history = [params.copy()]
    for step in range(steps):
        update = contribution(params, step, 0, 1)
        params = (params * 3 + update) % MOD
        history.append(params.copy())
    return history


async def train(comm, state, steps, seen, pause=0.0):
    while state.step < steps:
        update = contribution(state.params, state.step, comm.rank, comm.world_size)
        await comm.all_reduce(update)
        state.params = (state.params * 3 + update) % MOD
        state.step += 1
        state.commit()
        seen.append((state.step, comm.world_size, state.params.copy()))
        await asyncio.sleep(pause)
    return state.params


def test_state_commit_restore_and_values():
    state = State(params=np.zeros(3), step=0, note="x")
    state.params += 1
    state.step = 5
    state.restore()
    assert state.step == 0
    assert (state.params == 0).all()
    state.step = 2
    state.commit()
    state.step = 3
    state.restore()
    assert state.step == 2
    assert state.commits == 1
    with pytest.raises(ConfigError, match="msgpack"):
        state.bad = object()
    with pytest.raises(AttributeError, match="no value"):
        _ = state.missing


async def test_sync_gives_every_member_the_committed_state_of_rank_0():
    async with open_local_cluster(3, config=PATIENT) as cluster:
        states = [State(w=np.full(4, float(r)), step=r) for r in range(3)]
        states[0].w += 5  # not committed: the committed value travels
        await cluster.run(lambda c: states[c.rank].sync(c))
        for s in states:
            assert (s.w == 0).all()
            assert s.step == 0


def test_state_refuses_its_own_names_and_keeps_int_keyed_dicts():
    for name in ("commits", "commit", "names", "restore", "sync"):
        with pytest.raises(ConfigError, match="taken by State"):
            State(**{name: 5})  # it was accepted and then shadowed (commits read 0)
    state = State(counts={0: 1, 7: 2})
    assert state.counts == {0: 1, 7: 2}


async def test_sync_carries_dicts_with_int_keys():
    async with open_local_cluster(2, config=PATIENT) as cluster:
        states = [State(counts={r: r}, step=r) for r in range(2)]
        await cluster.run(lambda c: states[c.rank].sync(c))  # unpacking them failed
        assert [s.counts for s in states] == [{0: 0}, {0: 0}]


async def test_sync_with_other_arrays_fails_on_every_member_and_the_group_goes_on():
    async with open_local_cluster(2, config=CommConfig(timeout=10)) as cluster:
        states = [State(w=np.zeros(2)), State(v=np.zeros(2))]
        outcomes = await asyncio.gather(
            *(states[r].sync(cluster[r]) for r in range(2)), return_exceptions=True
        )
        for outcome in outcomes:  # rank 0 waited for the timeout, then every call failed
            assert isinstance(outcome, ConfigError), outcome
            assert "same arrays" in str(outcome)
        sums = await cluster.run(lambda c: c.all_reduce(np.ones(2)))
        for result in sums:
            np.testing.assert_array_equal(result, np.full(2, 2.0))


async def test_an_elastic_run_survives_a_loss_and_a_joiner_and_matches_the_fault_free_run():
    steps = 40
    expected = reference(steps)
    async with dsml.open_registry() as registry:
        comms: dict[int, dsml.Communicator] = {}
        seen: dict[int, list] = {r: [] for r in range(5)}

        async def member(index, pause):
            state = State(params=expected[0].copy(), step=0)

            async def fn(comm, state):
                comms[index] = comm
                return await train(comm, state, steps, seen[index], pause)

            return await dsml.elastic.run(
                fn, state, registry=registry.address, world_size=3, min_size=2, config=PATIENT
            )

        tasks = [asyncio.ensure_future(member(i, 0.01)) for i in range(3)]
        await eventually(lambda: min(len(seen[i]) for i in range(3)) >= 8, "steps", 20)
        await crash(comms[2])  # member 2 dies
        tasks[2].cancel()
        await eventually(lambda: min(len(seen[i]) for i in range(2)) >= 16, "steps", 20)
        tasks.append(asyncio.ensure_future(member(3, 0.01)))  # a new member joins
        results = await asyncio.gather(tasks[0], tasks[1], tasks[3])
        for params in results:
            assert (params == expected[steps]).all()
        sizes = {size for i in (0, 1) for _, size, _ in seen[i]}
        assert {2, 3} <= sizes, sizes  # it trained at 3, then 2, then 3 again
        assert seen[3][0][0] > 1  # the joiner started from the group's state
        for index in (0, 1, 3):  # every committed state is the fault-free one
            for step, _size, params in seen[index]:
                assert (params == expected[step]).all(), (index, step)
        await asyncio.gather(tasks[2], return_exceptions=True)


async def test_a_survivor_below_min_size_goes_on_with_the_replacement_that_joins():
    """world_size=2, min_size=2: one member dies, a replacement joins. The survivor waited
    for `comm.world_size` to grow, which happens only at its next collective, so it never
    crossed into the view with the joiner; the joiner then reported it silent, and both
    ended with BelowMinSizeError (a probe, 3/3). It now waits on the views announced."""
    steps = 30
    expected = reference(steps)
    async with dsml.open_registry() as registry:
        comms: dict[int, dsml.Communicator] = {}
        seen: dict[int, list] = {r: [] for r in range(3)}

        async def member(index):
            state = State(params=expected[0].copy(), step=0)

            async def fn(comm, state):
                comms[index] = comm
                return await train(comm, state, steps, seen[index], 0.01)

            return await dsml.elastic.run(
                fn,
                state,
                registry=registry.address,
                world_size=2,
                min_size=2,
                min_size_timeout=20,
                config=PATIENT,
            )

        tasks = [asyncio.ensure_future(member(i)) for i in range(2)]
        await eventually(lambda: min(len(seen[i]) for i in range(2)) >= 8, "steps", 20)
        await crash(comms[1])
        tasks[1].cancel()
        await asyncio.sleep(0.5)  # the survivor is below min_size now, waiting
        tasks.append(asyncio.ensure_future(member(2)))
        results = await asyncio.wait_for(asyncio.gather(tasks[0], tasks[2]), 30)
        for params in results:
            assert (params == expected[steps]).all()
        for index in (0, 2):
            for step, size, params in seen[index]:
                assert size == 2
                assert (params == expected[step]).all(), (index, step)
        await asyncio.gather(tasks[1], return_exceptions=True)


async def test_below_min_size_for_too_long_fails_clearly():
    beats = dsml.RegistryConfig(heartbeat_interval=0.05, heartbeat_timeout=0.5)
    async with open_local_cluster(2, config=PATIENT, registry_config=beats) as cluster:
        registry = cluster.registry.address
        await crash(cluster[1])
        await cluster[0].aclose()
        state = State(x=np.zeros(2), step=0)

        async def fn(comm, state):
            await comm.all_reduce(state.x)
            return comm.world_size

        # A fresh group of 1 forms; min_size=2 is never reached.
        with pytest.raises(BelowMinSizeError, match="min_size=2"):
            await dsml.elastic.run(
                fn, state, registry=registry, world_size=1, min_size=2, min_size_timeout=0.5
            )
