"""Sub-communicators: comm.split (MPI_Comm_split) and comm.new_group, in one process over
real sockets: layouts, uneven splits, concurrency with the parent, failure propagation,
and splits of sub-communicators (nested splits)."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dsml import (
    CollectiveMismatchError,
    CommConfig,
    ConfigError,
    MembershipChangedError,
    PeerLostError,
    ProtocolError,
)
from dsml.collectives import choose_all_reduce
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


async def test_numpy_integers_serve_as_ranks_roots_peers_colors_and_keys():
    """`np.arange(2)`, `np.int64(1)`: what numpy code hands over. Before, each was refused
    as "not a rank of this group (0..1)" although it was one."""
    async with open_local_cluster(3) as cluster:

        async def calls(comm):
            sub = await comm.new_group(np.arange(2))
            part = await comm.split(np.int64(comm.rank % 2), key=np.int32(-comm.rank))
            x = np.arange(3.0) + comm.rank
            await comm.broadcast(x, root=np.int64(2))
            if comm.rank < 2:
                await comm.send(np.array([comm.rank]), np.int64(1 - comm.rank), tag=np.uint8(3))
                got = int((await comm.recv(np.int64(1 - comm.rank), tag=np.int16(3)))[0])
            else:
                got = None
            with pytest.raises(ConfigError, match="root=True"):
                await comm.broadcast(x, root=True)  # a bool is not a rank
            return (sub.world_size if sub else None), part.world_size, x.tolist(), got

        rows = await cluster.run(calls)
    assert rows == [
        (2, 2, [2.0, 3.0, 4.0], 1),
        (2, 1, [2.0, 3.0, 4.0], 0),
        (None, 2, [2.0, 3.0, 4.0], None),
    ]


@pytest.mark.parametrize(
    "ranks", [np.array(0), itertools.count()], ids=["0-d array", "endless iterable"]
)
async def test_new_group_of_what_is_not_a_list_of_ranks_fails_on_every_rank_and_the_next_works(
    ranks,
):
    async with open_local_cluster(2, config=PATIENT) as cluster:

        async def calls(comm):
            with pytest.raises(ConfigError, match="new_group"):
                await comm.new_group(ranks if comm.rank == 0 else [0, 1])
            sub = await comm.new_group([0, 1])
            return int((await sub.all_reduce(np.ones(1)))[0])

        assert await cluster.run(calls) == [2, 2]


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


async def test_sub_groups_made_and_closed_in_a_loop_leave_nothing_held():
    """What members send a sub-group this rank already closed (their goodbyes) is dropped:
    it was held for good, about 1.5 messages per round at 4 ranks, until the budget ran
    out after some 6,700 rounds and a call hung for its timeout."""
    async with open_local_cluster(4, config=PATIENT) as cluster:

        async def rounds(comm):
            for r in range(60):
                sub = await (comm.split(comm.rank % 2) if r % 2 else comm.new_group([3, 2, 1, 0]))
                await sub.all_reduce(np.ones(4))
                await sub.aclose()
            await comm.barrier()  # each peer's goodbyes came before its barrier message
            return comm._session.demux._held

        assert await cluster.run(rounds) == [0, 0, 0, 0]


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


# -- nested splits: a split of a split ------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
async def test_a_split_of_a_split_ranks_by_the_sub_communicator_s_colors_and_keys(world):
    async with open_local_cluster(world) as cluster:

        async def nested(comm):
            sub = await comm.split(0, key=-comm.rank)  # sub-rank s is rank world - 1 - s
            odd = sub.rank % 2
            inner = await sub.split(odd, key=-(sub.rank // 2) if odd else 0)
            deepest = await inner.split(0, key=-inner.rank)  # a third level, reversed again
            me = np.array([comm.rank], dtype=np.int64)
            x = np.full(5, comm.rank + 1, dtype=np.int64)
            await inner.all_reduce(x)
            order = (await inner.all_gather(me)).tolist()
            deep = (await deepest.all_gather(me)).tolist()
            return sub.rank, inner.rank, inner.world_size, x.tolist(), order, deepest.rank, deep

        rows = await cluster.run(nested)
    for rank, (s, i, size, total, order, d, deep) in enumerate(rows):
        assert s == world - 1 - rank
        # colours and keys are the sub-communicator's: sub-ranks of one parity, the odd
        # ones by key -(s // 2) (reversed), the even ones by sub-rank (key 0)
        same = [t for t in range(world) if t % 2 == s % 2]
        if s % 2:
            same.sort(key=lambda t: -(t // 2))
        expected = [world - 1 - t for t in same]  # as the root's ranks
        assert order == expected
        assert (i, size) == (expected.index(rank), len(expected))
        assert total == [sum(r + 1 for r in expected)] * 5
        assert deep == expected[::-1]
        assert d == len(expected) - 1 - i


async def test_nested_splits_of_overlapping_sub_communicators_run_concurrently_and_stay_apart():
    async with open_local_cluster(4) as cluster:

        async def overlapping(comm):
            up = await comm.split(0)  # sub-rank = rank
            down = await comm.split(0, key=-comm.rank)  # sub-rank = 3 - rank
            # Nested splits of both at once, started in opposite orders on even and odd
            # ranks: the numbers their groups get must still agree and never collide.
            if comm.rank % 2:
                by_down, by_up = await asyncio.gather(down.split(down.rank // 2), up.split(0))
            else:
                by_up, by_down = await asyncio.gather(up.split(0), down.split(down.rank // 2))
            by_parity = await by_up.split(by_up.rank % 2)  # a nested split of a nested one
            me = np.array([comm.rank], dtype=np.int64)
            groups = [by_up, by_down, by_parity]
            handles = [g.all_gather(me) for g in (groups[::-1] if comm.rank % 2 else groups)]
            got = [(await h).tolist() for h in handles]
            numbers = {g._session.links.group for g in (up, down, *groups)}
            return got[::-1] if comm.rank % 2 else got, len(numbers)

        rows = await cluster.run(overlapping)
    for rank, ((every, halves, parity), distinct) in enumerate(rows):
        assert every == [0, 1, 2, 3]
        assert halves == ([3, 2] if rank >= 2 else [1, 0])  # down-ranks {0,1}, {2,3}
        assert parity == [rank % 2, rank % 2 + 2]
        assert distinct == 5  # five sub-groups on every rank, five numbers


async def test_collectives_of_a_nested_group_need_only_its_members():
    async with open_local_cluster(5, config=PATIENT) as cluster:
        subs = await cluster.run(lambda c: c.split(0, key=-c.rank))  # sub-rank = 4 - rank
        inner = await asyncio.gather(*(s.new_group([3, 1]) for s in subs))  # ranks 1, 3
        assert [g is None for g in inner] == [True, False, True, False, True]
        members = [inner[1], inner[3]]
        assert [g.rank for g in members] == [0, 1]  # sub-rank 3 (rank 1) first
        # Ranks 0, 2 and 4 make no call from here on; a short budget turns any wait for
        # them into a CollectiveTimeoutError.

        async def work(group):
            x = np.array([10 * group.rank + 1, 2], dtype=np.int64)
            await group.all_reduce(x, timeout=5)
            y = np.arange(3) if group.rank == 1 else np.zeros(3, dtype=np.int64)
            await group.broadcast(y, root=1, timeout=5)
            await group.barrier(timeout=5)
            if group.rank == 0:
                await group.send(np.array([7]), 1, timeout=5)
                return x.tolist(), y.tolist(), None
            return x.tolist(), y.tolist(), (await group.recv(0, timeout=5)).tolist()

        out = await asyncio.gather(*(work(g) for g in members))
        assert all(c.statistics()["in_flight"] == 0 for c in cluster)
    assert out[0][:2] == out[1][:2] == ([1 + 11, 4], [0, 1, 2])
    assert out[1][2] == [7]


async def test_a_bad_nested_split_or_a_mismatched_call_fails_on_every_rank_of_the_sub():
    async with open_local_cluster(6, config=CommConfig(timeout=10, join_timeout=10)) as cluster:
        subs = await cluster.run(lambda c: c.split(c.rank % 2))  # {0, 2, 4}, {1, 3, 5}
        evens, odds = subs[0::2], subs[1::2]
        bad = await asyncio.gather(
            *(s.split("red" if s.rank == 1 else 0) for s in evens), return_exceptions=True
        )
        assert all(isinstance(o, ConfigError) and "rank(s) [1]" in str(o) for o in bad), bad
        bad = await asyncio.gather(
            *(s.new_group([0, 1] if s.rank else [0, 2]) for s in evens), return_exceptions=True
        )
        assert all(isinstance(o, ConfigError) and "same" in str(o) for o in bad), bad
        mixed = await asyncio.gather(
            odds[0].split(0),
            odds[1].split(0),
            odds[2].all_reduce(np.ones(2)),
            return_exceptions=True,
        )
        assert all(isinstance(o, CollectiveMismatchError) for o in mixed), mixed
        # both sub-communicators are still in step: a nested split works on each
        again = await asyncio.gather(*(s.split(0) for s in subs))
        sums = await asyncio.gather(*(g.all_reduce(np.ones(2, dtype=np.int64)) for g in again))
        assert all(r.tolist() == [3, 3] for r in sums)


async def test_a_member_s_death_fails_nested_calls_and_splits_at_once_then_they_refuse():
    async with open_local_cluster(4, config=PATIENT) as cluster:
        subs = await cluster.run(lambda c: c.split(0))
        inner = await asyncio.gather(*(s.split(s.rank % 2) for s in subs))  # {0,2}, {1,3}
        victim, survivors = 3, [0, 1, 2]
        pending = inner[1].all_reduce(np.ones(8))  # needs rank 3, which never makes it
        await crash(cluster[victim])
        with pytest.raises(PeerLostError):
            await pending
        await eventually(lambda: all(cluster[r].world_size == 3 for r in survivors), "the loss")
        # Every survivor: nested calls and nested splits fail at once naming the loss (a
        # wait for the dead rank would end in CollectiveTimeoutError, after 30 s).
        outcomes = await asyncio.gather(
            *(inner[r].all_reduce(np.ones(2)) for r in survivors),
            *(subs[r].split(0) for r in survivors),
            return_exceptions=True,
        )
        assert all(isinstance(o, PeerLostError) and o.lost == (victim,) for o in outcomes), outcomes
        # The root's own program sees the loss once on every survivor, then moves on.
        first = await asyncio.gather(
            *(cluster[r].all_reduce(np.ones(2)) for r in survivors), return_exceptions=True
        )
        assert all(isinstance(o, PeerLostError) for o in first), first
        results = await asyncio.gather(*(cluster[r].all_reduce(np.ones(2)) for r in survivors))
        assert all((r == 3).all() for r in results)
        with pytest.raises(MembershipChangedError, match="split"):
            await inner[0].all_reduce(np.ones(2))
        fresh = await asyncio.gather(*(cluster[r].split(0) for r in survivors))
        nested = await asyncio.gather(*(s.split(s.rank // 2) for s in fresh))  # {0,1}, {2}
        sums = await asyncio.gather(*(g.all_reduce(np.ones(2)) for g in nested))
        assert [r.tolist() for r in sums] == [[2, 2], [2, 2], [1, 1]]


async def test_closing_a_sub_communicator_closes_its_nested_groups_and_the_rest_goes_on():
    async with open_local_cluster(3) as cluster:
        subs = await cluster.run(lambda c: c.split(0))
        inner = await asyncio.gather(*(s.split(0, key=-s.rank) for s in subs))
        await asyncio.gather(*(s.aclose() for s in subs))
        with pytest.raises(ConfigError):
            inner[0].all_reduce(np.ones(2))
        assert all(c._groups.subs == {} for c in cluster)  # nothing of them is left routed
        again = await cluster.run(lambda c: c.split(0))
        results = await asyncio.gather(*(s.all_reduce(np.ones(2)) for s in again))
        assert all((r == 3).all() for r in results)


NESTED_SCRIPT = Path(__file__).resolve().parent / "scripts" / "nested_split.py"


def _events(proc: subprocess.Popen[str]) -> list[dict]:
    assert proc.stdout is not None
    return [json.loads(line) for line in proc.stdout if line.startswith("{")]


@pytest.mark.multiprocess
def test_processes_split_a_split_and_a_kill_9_fails_nested_calls_on_every_survivor(tmp_path):
    """Four processes (tests/scripts/nested_split.py); rank 3 is killed with SIGKILL while
    rank 1's nested all_reduce waits for it."""
    root = NESTED_SCRIPT.parent.parent.parent
    registry = subprocess.Popen(
        [sys.executable, "-m", "dsml", "registry", "--address", "tcp://127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "registry.err").open("w"),
        text=True,
        cwd=root,
    )
    workers: list[subprocess.Popen[str]] = []
    try:
        assert registry.stdout is not None
        address = registry.stdout.readline().split()[4]
        for i in range(4):
            workers.append(
                subprocess.Popen(
                    [sys.executable, str(NESTED_SCRIPT), "--registry", address],
                    stdout=subprocess.PIPE,
                    stderr=(tmp_path / f"worker{i}.err").open("w"),
                    text=True,
                    cwd=root,
                )
            )
        ranks, ready = {}, set()
        for proc in workers:  # each prints joined, exact, ready before it waits
            assert proc.stdout is not None
            for line in proc.stdout:
                event = json.loads(line)
                if event["event"] == "joined":
                    ranks[event["rank"]] = proc
                if event["event"] == "exact":
                    members = event["members"]  # sub-ranks of one parity; sub-rank = 3 - rank
                    assert members == ([3, 1] if event["rank"] % 2 else [2, 0]), event
                    assert event["total"] == sum(r + 1 for r in members), event
                if event["event"] == "ready":
                    ready.add(event["rank"])
                    break
        assert ready == {0, 1, 2, 3}
        ranks[3].send_signal(signal.SIGKILL)
        ranks[3].wait(timeout=10)
        survivors = {rank: ranks[rank] for rank in (0, 1, 2)}
        for proc in survivors.values():
            proc.wait(timeout=45)
        logs = {r: _events(p) for r, p in survivors.items()}
        errors = {
            r: (tmp_path / f"worker{workers.index(p)}.err").read_text()[-2000:]
            for r, p in survivors.items()
        }
        assert all(p.returncode == 0 for p in survivors.values()), errors
        for rank, events in logs.items():
            steps = {e["step"]: e["type"] for e in events if e["event"] == "outcome"}
            expected = {
                "nested split": "PeerLostError",
                "root call 1": "PeerLostError",  # the root's program sees the loss once
                "root call 2": "ok",
            }
            if rank == 1:
                expected["nested call in flight"] = "PeerLostError"
            assert steps == expected, (rank, events)
            (after,) = [e for e in events if e["event"] == "after"]
            assert after["rank"] in after["members"]
            assert after["total"] == sum(r + 1 for r in after["members"]), after
        groups = {tuple(e["members"]) for es in logs.values() for e in es if e["event"] == "after"}
        assert sorted(r for g in groups for r in g) == [0, 1, 2]
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        registry.send_signal(signal.SIGTERM)
        try:
            registry.wait(timeout=10)
        except subprocess.TimeoutExpired:
            registry.kill()
            registry.wait(timeout=10)


def test_numbers_of_root_and_nested_sub_groups_never_meet_and_fit_a_stamped_id():
    from dsml.communicator import subgroups

    top = {subgroups.group_id(k, i) for k in (1, 2, (1 << 14) - 1) for i in (0, 1, 0xFFFE)}
    assert len(top) == 9
    assert max(top) < subgroups.NESTED
    for world in (1, 2, 3, 7):
        nested = {subgroups.nested_group_id(r, c, world) for r in range(world) for c in range(50)}
        assert len(nested) == 50 * world
        assert min(nested) >= subgroups.NESTED
        most = (subgroups.NESTED - world) // world  # the last reservation that fits
        last = subgroups.nested_group_id(world - 1, most, world)
        assert (last << subgroups.GROUP_SHIFT | 0xFFFFFFFF) < 1 << 63  # a valid envelope cid
        with pytest.raises(ConfigError, match="ran out"):
            subgroups.nested_group_id(world - 1, most + 1, world)
    with pytest.raises(ConfigError, match="split at most"):
        subgroups.group_id(1 << 14, 0)
    assert subgroups.unpack_rows([3, 1, 7, 1, 4, 0, 5, 9]) == [[1, 7], [], [0, 5, 9]]


async def test_a_sub_communicator_answers_what_its_parent_answers_and_runs_its_close_hooks():
    # cost_model, all_reduce_choice and on_close are the Communicator's, on a sub-group too
    # (they once raised AttributeError there): no measured model, the size table's choice.
    async with open_local_cluster(4) as cluster:

        async def probe(comm):
            sub = await comm.split(comm.rank % 2)
            closed: list[int] = []

            async def hook() -> None:
                closed.append(sub.rank)

            sub.on_close(hook)
            choice = sub.all_reduce_choice(4096)
            before = list(closed)
            await sub.aclose()
            await sub.aclose()  # a second close does nothing, hooks included
            total = await comm.all_reduce(np.ones(2))  # the parent stays open
            return sub.cost_model, choice.algorithm, choice.chunk_bytes, before, closed, total

        rows = await cluster.run(probe)
    for rank, (model, algorithm, chunk, before, closed, total) in enumerate(rows):
        assert model is None
        assert algorithm == choose_all_reduce(4096, 2)
        assert chunk == cluster[rank].config.chunk_bytes
        assert before == []
        assert closed == [rank // 2]
        np.testing.assert_array_equal(total, [4.0, 4.0])
