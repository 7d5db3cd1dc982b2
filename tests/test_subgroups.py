"""Sub-communicators: comm.split (MPI_Comm_split) and comm.new_group, in one process over
real sockets: layouts, uneven splits, concurrency with the parent, failure propagation."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from dsml import CommConfig, ConfigError, MembershipChangedError, PeerLostError, ProtocolError
from dsml.testing import crash, open_local_cluster
from tests.waiting import eventually

PATIENT = CommConfig(timeout=30, join_timeout=10)


def ranks_of(x):
    return sorted(int(v) for v in np.asarray(x).ravel())


async def test_a_2x2_data_by_tensor_layout_at_world_4_gives_each_rank_its_two_groups():
    async with open_local_cluster(4) as cluster:

        async def layout(comm):
            data = await comm.split(comm.rank % 2)  # data-parallel replicas: {0,2}, {1,3}
            tensor = await comm.split(comm.rank // 2)  # tensor-parallel shards: {0,1}, {2,3}
            me = np.array([comm.rank], dtype=np.int64)
            # Issued in a different order on even and odd ranks: sub-groups have their own
            # collective ids, so the three calls run concurrently and match within a group.
            if comm.rank % 2:
                handles = [tensor.all_gather(me), data.all_gather(me), comm.all_gather(me)]
            else:
                handles = [comm.all_gather(me), data.all_gather(me), tensor.all_gather(me)]
            results = [(await h).tolist() for h in handles]
            if comm.rank % 2:
                results = results[::-1]
            return data.rank, data.world_size, tensor.rank, tensor.world_size, results

        rows = await cluster.run(layout)
    for rank, (d_rank, d_size, t_rank, t_size, (every, data, tensor)) in enumerate(rows):
        assert every == [0, 1, 2, 3]
        assert data == [rank % 2, rank % 2 + 2]
        assert tensor == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert (d_rank, d_size, t_rank, t_size) == (rank // 2, 2, rank % 2, 2)


async def test_uneven_splits_at_world_7_order_by_key_then_rank_and_none_gets_none():
    async with open_local_cluster(7) as cluster:

        async def uneven(comm):
            color = None if comm.rank == 6 else comm.rank % 3  # {0,3}, {1,4}, {2,5}; 6 out
            key = -comm.rank if color == 0 else 0  # colour 0 in reverse order
            sub = await comm.split(color, key=key)
            if sub is None:
                return None
            x = np.full(3, comm.rank + 1, dtype=np.int64)
            await sub.all_reduce(x)
            order = (await sub.all_gather(np.array([comm.rank]))).tolist()
            return sub.rank, sub.world_size, int(x[0]), order

        rows = await cluster.run(uneven)
    assert rows[6] is None
    assert rows[0] == (1, 2, 1 + 4, [3, 0])  # key -rank: rank 3 first
    assert rows[3] == (0, 2, 5, [3, 0])
    assert rows[1] == (0, 2, 2 + 5, [1, 4])  # equal keys: by rank
    assert rows[5] == (1, 2, 3 + 6, [2, 5])


async def test_new_group_ranks_members_in_the_order_given_and_others_get_none():
    async with open_local_cluster(7) as cluster:

        async def group(comm):
            sub = await comm.new_group([5, 1, 3])
            if sub is None:
                return None
            x = np.array([comm.rank], dtype=np.int64)
            return sub.rank, (await sub.all_gather(x)).tolist(), int((await sub.all_reduce(x))[0])

        rows = await cluster.run(group)
    assert rows[5] == (0, [5, 1, 3], 9)
    assert rows[1] == (1, [5, 1, 3], 9)
    assert rows[3] == (2, [5, 1, 3], 9)
    assert [rows[r] for r in (0, 2, 4, 6)] == [None] * 4


async def test_bad_split_or_group_arguments_fail_on_every_rank_with_a_clear_error():
    async with open_local_cluster(3) as cluster:
        outcomes = await asyncio.gather(
            *(c.split("red" if c.rank == 1 else 0) for c in cluster), return_exceptions=True
        )
        assert all(isinstance(o, ConfigError) and "rank(s) [1]" in str(o) for o in outcomes)
        outcomes = await asyncio.gather(
            *(c.new_group([0, 1] if c.rank else [0, 2]) for c in cluster), return_exceptions=True
        )
        assert all(isinstance(o, ConfigError) and "same" in str(o) for o in outcomes), outcomes
        # the group is still usable, and in step
        results = await cluster.run(lambda c: c.all_reduce(np.ones(2)))
        assert all((r == 3).all() for r in results)


async def test_a_member_s_death_fails_the_calls_of_parent_and_sub_groups_and_old_subs_refuse():
    async with open_local_cluster(4, config=PATIENT) as cluster:

        async def layout(comm):
            return await comm.split(comm.rank % 2), await comm.split(comm.rank // 2)

        subs = await cluster.run(layout)
        victim = 3
        survivors = [c for c in cluster if c.rank != victim]
        # Calls that need rank 3, which never makes them: they are in flight when it dies.
        parent = [c.all_reduce(np.ones(8)) for c in survivors]
        data_1 = subs[1][0].all_reduce(np.ones(8))  # {1, 3}
        tensor_2 = subs[2][1].all_reduce(np.ones(8))  # {2, 3}
        await asyncio.sleep(0.01)
        await crash(cluster[victim])
        outcomes = await asyncio.gather(*parent, data_1, tensor_2, return_exceptions=True)
        assert all(isinstance(o, PeerLostError) for o in outcomes), outcomes
        assert all(o.lost == (victim,) for o in outcomes[:3])
        # The survivors go on in a new view; sub-groups of the old one refuse calls.
        await eventually(lambda: all(c.world_size == 3 for c in survivors), "the new view")
        results = await asyncio.gather(*(c.all_reduce(np.ones(2)) for c in survivors))
        assert all((r == 3).all() for r in results)
        with pytest.raises(MembershipChangedError, match="split"):
            await subs[0][0].all_reduce(np.ones(2))
        fresh = await asyncio.gather(*(c.split(0) for c in survivors))
        assert [s.world_size for s in fresh] == [3, 3, 3]
        sums = await asyncio.gather(*(s.all_reduce(np.ones(2)) for s in fresh))
        assert all((r == 3).all() for r in sums)


async def test_closing_a_sub_group_leaves_the_parent_working():
    async with open_local_cluster(3) as cluster:
        subs = await cluster.run(lambda c: c.split(0))
        await asyncio.gather(*(s.aclose() for s in subs))
        results = await cluster.run(lambda c: c.all_reduce(np.ones(2)))
        assert all((r == 3).all() for r in results)
        with pytest.raises(ConfigError):
            subs[0].all_reduce(np.ones(2))


def test_messages_for_a_sub_group_not_made_yet_are_held_within_a_budget_then_delivered():
    from dsml.communicator import subgroups
    from dsml.wire import Envelope, Kind

    seen = []
    parent = {Kind.CHUNK: lambda rank, env, payload: seen.append(("parent", rank, env.cid))}
    demux = subgroups.Demux(parent)
    group = subgroups.group_id(1, 0)
    early = Envelope(Kind.CHUNK, 1, 4, (group << subgroups.GROUP_SHIFT) | 7)
    demux.routes[Kind.CHUNK](4, early, [])
    demux.routes[Kind.CHUNK](2, Envelope(Kind.CHUNK, 1, 2, 3), [])
    assert seen == [("parent", 2, 3)]  # the sub-group's message waits
    sub = {Kind.CHUNK: lambda rank, env, payload: seen.append(("sub", rank, env.cid, env.src))}
    demux.add(group, sub, [1, 4])  # parent rank 4 is sub-rank 1
    assert seen[-1] == ("sub", 1, 7, 1)
    big = memoryview(bytearray(1 << 20))
    other = (subgroups.group_id(2, 0) << subgroups.GROUP_SHIFT) | 1
    for _ in range(256):  # 256 MiB held for a group not made yet: the budget
        demux.routes[Kind.CHUNK](4, Envelope(Kind.CHUNK, 1, 4, other), [big])
    with pytest.raises(ProtocolError, match="not made here"):
        demux.routes[Kind.CHUNK](4, Envelope(Kind.CHUNK, 1, 4, other), [big])
