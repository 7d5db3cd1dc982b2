"""The same-host shared-memory path: segments, the link, the algorithms, the communicator.

Segment and link tests run real processes (started by a multiprocessing fork server) over real
/dev/shm segments; communicator tests run an in-process cluster, whose members all share
this host, so `auto` runs in shared memory. Names are unique per test (member ids carry
the test's PID and a counter), and every test checks that it left no /dev/shm file.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import itertools
import logging
import multiprocessing as mp
import os
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import dsml
from dsml.collectives import shm_plane
from dsml.collectives.all_reduce_shm import (
    BUFFER_BYTES,
    MAX_PIECES,
    PAIR_BYTES,
    PAIR_PIECE_BYTES,
    PIECE_BYTES,
    all_reduce_shm,
    piece_plan,
)
from dsml.collectives.ops import ReduceOp
from dsml.collectives.shm_plane import HostMember, SameHost
from dsml.communicator import plan_reductions
from dsml.communicator.shm_hook import ShmHook
from dsml.testing import crash, open_local_cluster
from dsml.transport.shm_segment import SHM_DIR, Segment, segment_name, sweep_orphans

_COUNTER = itertools.count()
# Not "fork": by the time these tests run, other tests have imported JAX (threads), and a
# forked child of a threaded process may deadlock. The fork server starts clean, with the
# modules the children use loaded once.
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["numpy", "dsml", __name__])


def unique() -> str:
    return f"t{os.getpid()}x{next(_COUNTER)}"


def leftovers(tag: str) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if tag in n]


@pytest.fixture(autouse=True)
def shm_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shared memory on for every communicator here, whatever the environment says."""
    monkeypatch.setenv("DSML_SHM", "1")


@pytest.fixture
def tag() -> Iterator[str]:
    """A unique tag for this test's segment names; fails the test if any is left."""
    value = unique()
    yield value
    left = leftovers(value)
    assert not left, f"segments left in {SHM_DIR}: {left}"


# -- segments ------------------------------------------------------------------------------


def test_a_segment_is_visible_to_another_process_until_unlinked(tag: str) -> None:
    seg = Segment.create(segment_name(os.getpid(), tag, 1, "c"), 1 << 16)
    np.frombuffer(seg.map, np.uint8)[:4] = [1, 2, 3, 4]
    peer = Segment.open(seg.name)
    assert peer is not None
    assert list(np.frombuffer(peer.map, np.uint8)[:4]) == [1, 2, 3, 4]
    seg.unlink()
    assert Segment.open(seg.name) is None
    np.frombuffer(seg.map, np.uint8)[0] = 9  # still mapped: the memory lives on
    assert np.frombuffer(peer.map, np.uint8)[0] == 9
    peer.close()
    seg.close()


def _make_segment_and_hang(name_tag: str, ready: Any) -> None:
    Segment.create(segment_name(os.getpid(), name_tag, 1, "c"), 4096)
    ready.set()
    time.sleep(60)


def test_sweeping_removes_segments_of_killed_processes_but_not_of_live_ones(tag: str) -> None:
    ready = CTX.Event()
    child = CTX.Process(target=_make_segment_and_hang, args=(tag, ready))
    child.start()
    assert ready.wait(20)
    mine = Segment.create(segment_name(os.getpid(), tag, 1, "d1"), 4096)
    sweep_orphans()
    assert len(leftovers(tag)) == 2  # both owners alive
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    removed = sweep_orphans()
    assert [n for n in removed if tag in n] == [segment_name(child.pid, tag, 1, "c")]
    assert leftovers(tag) == [mine.name]
    mine.close()


def test_a_view_no_shared_memory_call_can_use_makes_no_segment(tag: str) -> None:
    # Two ranks share this host, the third has shared memory off (DSML_SHM=0): no call
    # runs in shared memory (not all local; hosts of unequal size), so no names are made
    # for a crash to leave behind. With all three local, the link is made at once.
    pid = os.getpid()
    members = [HostMember(f"{tag}r{r}", "host", "id", pid) for r in range(2)]
    plane = SameHost(enabled=True, stage_bytes=1 << 20, max_data_bytes=1 << 30)
    try:
        plane.set_view(1, [*members, HostMember(f"{tag}r2", "host", "", pid)], 0)
        assert leftovers(tag) == []
        plane.set_view(2, [*members, HostMember(f"{tag}r2", "host", "id", pid)], 0)
        assert leftovers(tag) != []
    finally:
        plane.close()


# -- the link and the algorithm, across real processes ----------------------------------------


def _plane(tag: str, rank: int, pids: list[int], **options: Any) -> SameHost:
    members = [HostMember(f"{tag}r{r}", "host", "id", pid) for r, pid in enumerate(pids)]
    plane = SameHost(
        enabled=True,
        stage_bytes=options.get("stage_bytes", 1 << 20),
        max_data_bytes=options.get("max_data_bytes", 1 << 30),
    )
    plane.set_view(1, members, rank)
    return plane


def _reduce_worker(
    tag: str, rank: int, inbox: Any, results: Any, cases: list[Any], stage: int
) -> None:
    pids = inbox.get()
    plane = _plane(tag, rank, pids, stage_bytes=stage)

    async def run() -> None:
        for cid, (n, dtype, op) in enumerate(cases, start=1):
            x = (np.arange(n) % 13 + rank + 1).astype(dtype)
            fp = f"{n}{dtype}{op}".encode()
            done = await plane.run(
                cid, fp, lambda g, x=x, op=op: all_reduce_shm(g, x, x, ReduceOp(op), stage)
            )
            results.put((rank, cid, done, x.tobytes()))
        plane.close()

    asyncio.run(run())


@pytest.mark.parametrize("stage", [64 << 10, 8 << 20])
@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_shm_between_processes_is_exact_small_large_and_in_pieces(
    tag: str, world: int, stage: int
) -> None:
    # 100, 40_000 elements: inline; 300_001, 400_000: several pieces of the 64 KiB stage,
    # or at 2 ranks with an 8 MiB stage the pair schedule (512 KiB pieces)
    cases = [(100, "int64", "sum"), (40_000, "float32", "max"), (300_001, "int32", "sum")]
    cases += [(400_000, "float32", "max"), (300_000, "float64", "avg")]
    cases += [(0, "float64", "sum"), (5000, "float64", "avg"), (1, "int8", "min")]
    inboxes = [CTX.Queue() for _ in range(world)]
    results = CTX.Queue()
    procs = [
        CTX.Process(target=_reduce_worker, args=(tag, r, inboxes[r], results, cases, stage))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        for box in inboxes:
            box.put([p.pid for p in procs])
        got = [results.get(timeout=30) for _ in range(world * len(cases))]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    for _rank, cid, done, raw in got:
        n, dtype, op = cases[cid - 1]
        inputs = [(np.arange(n) % 13 + r + 1).astype(dtype) for r in range(world)]
        expected = {
            "sum": lambda: np.sum(inputs, axis=0, dtype=dtype),
            "max": lambda: np.max(inputs, axis=0),
            "min": lambda: np.min(inputs, axis=0),
            "avg": lambda: np.sum(inputs, axis=0) / world,
        }[op]()
        assert done
        np.testing.assert_array_equal(np.frombuffer(raw, dtype), expected.astype(dtype))
    by_call: dict[int, set[bytes]] = {}
    for _rank, cid, _done, raw in got:
        by_call.setdefault(cid, set()).add(raw)
    assert all(len(v) == 1 for v in by_call.values()), "ranks ended with different bits"


@pytest.mark.parametrize("size", [2, 3, 4, 7])
@pytest.mark.parametrize("itemsize", [1, 4, 8])
@pytest.mark.parametrize("stage_bytes", [4096, 64 << 10, 8 << 20])
def test_large_pieces_cover_every_slice_and_two_buffers_fit_the_staging_budget(
    size: int, itemsize: int, stage_bytes: int
) -> None:
    for longest in [1, 1000, 65_537, 2_000_001, 300_000_000]:
        slot, pieces = piece_plan(longest, size, itemsize, stage_bytes)
        assert slot * pieces >= longest > slot * (pieces - 1)  # covers, none empty
        assert pieces <= MAX_PIECES  # a sync each: the phases fit the progress word
        if pieces == MAX_PIECES or slot * MAX_PIECES >= longest > (slot - 1) * MAX_PIECES:
            continue  # pieces grown to stay within MAX_PIECES: past the budget, on purpose
        buffers = 2 if pieces > 1 else 1
        staged = buffers * (size - 1) * slot * itemsize
        assert staged <= max(stage_bytes, (size - 1) * itemsize)  # one element at least
        if pieces > 1:
            assert slot * itemsize <= PIECE_BYTES
            assert (size - 1) * slot * itemsize <= BUFFER_BYTES


def _loop_until_killed(tag: str, rank: int, inbox: Any, started: Any) -> None:
    pids = inbox.get()
    plane = _plane(tag, rank, pids, stage_bytes=256 << 10)

    async def run() -> None:
        rng = random.Random(7)  # the same sizes on both ranks
        for cid in itertools.count(1):
            n = rng.choice([10, 50_000, 400_000, 2_000_000])  # data segments keep growing
            x = np.ones(n, np.float32)
            await plane.run(
                cid, str(n).encode(), lambda g, x=x: all_reduce_shm(g, x, x, ReduceOp.SUM, 1 << 18)
            )
            if cid == 2:
                started.set()

    asyncio.run(run())


def test_kill_9_of_ranks_mid_operation_twenty_times_leaves_no_segment_behind(tag: str) -> None:
    """Two processes loop over all_reduces; one is killed with SIGKILL at a random moment,
    then the other (as its communicator would be closed or killed too). Segment names are
    unlinked once mapped, and the sweep of the next start removes the rest."""
    seed = random.randrange(1 << 30)
    print(f"seed={seed}")
    rng = random.Random(seed)
    for round_ in range(20):
        round_tag = f"{tag}k{round_}"
        inboxes = [CTX.Queue() for _ in range(2)]
        started = CTX.Event()
        procs = [
            CTX.Process(target=_loop_until_killed, args=(round_tag, r, inboxes[r], started))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        for box in inboxes:
            box.put([p.pid for p in procs])
        assert started.wait(20), "the processes did not get going"
        time.sleep(rng.uniform(0, 0.02))
        victim = rng.randrange(2)
        for p in (procs[victim], procs[1 - victim]):
            os.kill(p.pid, signal.SIGKILL)
            p.join(10)
        sweep_orphans()  # what the next link to start does
        assert not leftovers(round_tag), f"round {round_}: {leftovers(round_tag)}"


# -- through the communicator ----------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 4])
async def test_all_reduce_runs_in_shared_memory_on_one_host_and_is_exact(world: int) -> None:
    async with open_local_cluster(world) as comms:
        assert all(c._session.shm.plane.all_local for c in comms)
        cases = [(0, "int32", "sum"), (7, "int64", "prod"), (70_000, "float32", "max")]
        bitwise = [(5_000_000, "uint8", "bxor"), (300_000, "int64", "bor"), (9, "bool", "band")]
        for n, dtype, op in [*cases, (600_000, "int32", "min"), *bitwise]:
            xs = [(np.arange(n) % 5 + r + 1).astype(dtype) for r in range(world)]
            expected = {
                "sum": np.sum,
                "prod": np.prod,
                "max": np.max,
                "min": np.min,
                "band": np.bitwise_and.reduce,
                "bor": np.bitwise_or.reduce,
                "bxor": np.bitwise_xor.reduce,
            }[op](xs, axis=0)
            await asyncio.gather(*(c.all_reduce(x, op) for c, x in zip(comms, xs, strict=True)))
            for x in xs:
                np.testing.assert_array_equal(x, expected.astype(dtype))
        # non-contiguous input, algorithm named explicitly
        base = [np.arange(40, dtype=np.float64).reshape(8, 5) * (r + 1) for r in range(world)]
        views = [b[:, 1:4] for b in base]
        await asyncio.gather(
            *(c.all_reduce(v, algorithm="shm") for c, v in zip(comms, views, strict=True))
        )
        total = sum(range(1, world + 1))
        for b in base:
            np.testing.assert_array_equal(b[:, 1:4], np.arange(40.0).reshape(8, 5)[:, 1:4] * total)
        await asyncio.gather(*(c.barrier() for c in comms))
        assert all(
            c._session.shm.plane.calls == 9 for c in comms
        )  # every call ran in shared memory


async def test_ranks_calling_different_shapes_fail_with_a_mismatch_on_every_rank() -> None:
    async with open_local_cluster(3) as comms:
        xs = [np.ones(10 + (r == 2), np.float32) for r in range(3)]
        results = await asyncio.gather(
            *(c.all_reduce(x, algorithm="shm") for c, x in zip(comms, xs, strict=True)),
            return_exceptions=True,
        )
        assert all(isinstance(r, dsml.CollectiveMismatchError) for r in results), results
        assert all((x == 1).all() for x in xs)  # inputs intact
        ys = [np.full(4, r, np.int64) for r in range(3)]  # the next call is fine
        await asyncio.gather(*(c.all_reduce(y) for c, y in zip(comms, ys, strict=True)))
        assert all((y == 3).all() for y in ys)


@pytest.mark.parametrize("kind", ["all_reduce", "broadcast", "reduce_scatter"])
async def test_ranks_with_different_staging_sizes_fail_on_every_rank_saying_so(kind: str):
    # The staging size cuts the data into pieces: ranks that differ read each other's
    # areas wrongly (wrong sums on some ranks, a timeout on another, before this check).
    stages = [4096, 3 << 20, 8 << 20]
    async with dsml.open_registry("tcp://127.0.0.1:0") as reg:
        comms = await asyncio.gather(
            *(
                dsml.init(reg.address, 3, rank=r, config=dsml.CommConfig(shm_stage_bytes=s))
                for r, s in enumerate(stages)
            )
        )
        try:
            xs = [np.full(3_000_001, r + 1, np.float32) for r in range(3)]
            calls = {
                "all_reduce": lambda c, x: c.all_reduce(x),
                "broadcast": lambda c, x: c.broadcast(x, 1),
                "reduce_scatter": lambda c, x: c.reduce_scatter(x),
            }
            results = await asyncio.wait_for(
                asyncio.gather(
                    *(calls[kind](c, x) for c, x in zip(comms, xs, strict=True)),
                    return_exceptions=True,
                ),
                10,
            )
            for result in results:
                assert isinstance(result, dsml.CollectiveMismatchError), results
                assert "shm_stage_bytes" in str(result)
            assert all((x == r + 1).all() for r, x in enumerate(xs))  # inputs intact
        finally:
            await asyncio.gather(*(c.aclose() for c in comms))


async def test_without_room_in_dev_shm_large_arrays_go_over_tcp_with_one_warning() -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("dsml.shm")  # its own handler: dsml's logger may not propagate
    logger.addHandler(handler)
    config = dsml.CommConfig(shm_max_bytes=256 << 10)  # as if /dev/shm were tiny
    try:
        async with open_local_cluster(2, config=config) as comms:
            for _ in range(2):
                xs = [np.full(1 << 20, r + 1, np.int32) for r in range(2)]  # 4 MiB
                await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs, strict=True)))
                assert all((x == 3).all() for x in xs)
    finally:
        logger.removeHandler(handler)
    warnings = [r for r in records if "/dev/shm" in r.getMessage()]
    assert len(warnings) == 2  # one per communicator, not one per call


async def test_dsml_shm_0_keeps_every_collective_on_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSML_SHM", "0")
    async with open_local_cluster(2) as comms:
        assert not comms[0].config.shm
        assert comms[0].view.members[0].host_id == ""
        assert not comms[0]._session.shm.plane.all_local
        xs = [np.full(5, r + 1, np.int32) for r in range(2)]
        await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs, strict=True)))
        assert all((x == 3).all() for x in xs)
        assert comms[0]._session.shm.plane.calls == 0


def test_dsml_shm_config_is_validated() -> None:
    with pytest.raises(dsml.ConfigError):
        dsml.CommConfig(shm_stage_bytes=10)
    assert dataclasses.replace(dsml.CommConfig(), shm=False).shm is False


async def test_a_dsml_shm_value_that_is_neither_on_nor_off_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before, DSML_SHM=nope (or DSML_SHM=disabled) left shared memory on without a word."""
    monkeypatch.setenv("DSML_SHM", "disabled")
    with pytest.raises(dsml.ConfigError, match="DSML_SHM='disabled': use 1"):
        await dsml.init("tcp://127.0.0.1:9", world_size=1)


@pytest.mark.parametrize("n", [5, 300_001])  # inline; several pieces of a 64 KiB stage
async def test_broadcast_all_gather_and_reduce_scatter_in_shared_memory_are_exact(n: int) -> None:
    world = 3
    config = dsml.CommConfig(shm_stage_bytes=64 << 10)
    async with open_local_cluster(world, config=config) as comms:
        xs = [np.full(n, r + 1, np.int32) for r in range(world)]
        xs[1][:] = np.arange(n) % 1000
        await asyncio.gather(*(c.broadcast(x, root=1) for c, x in zip(comms, xs, strict=True)))
        for x in xs:
            np.testing.assert_array_equal(x, np.arange(n) % 1000)

        blocks = [np.full((n // 10 + r, 3), r, np.int64) for r in range(world)]  # rows differ
        gathered = await asyncio.gather(
            *(c.all_gather(b) for c, b in zip(comms, blocks, strict=True))
        )
        for g in gathered:
            np.testing.assert_array_equal(g, np.concatenate(blocks))

        ys = [(np.arange(n) % 7 + r).astype(np.int64) for r in range(world)]
        parts = await asyncio.gather(*(c.reduce_scatter(y) for c, y in zip(comms, ys, strict=True)))
        total = np.sum(ys, axis=0)
        for r, part in enumerate(parts):
            np.testing.assert_array_equal(part, np.array_split(total, world)[r])
        assert all((y == np.arange(n) % 7 + r).all() for r, y in enumerate(ys))  # inputs kept
        assert all(c._session.shm.plane.calls == 3 for c in comms)  # all in shared memory


async def test_an_all_reduce_of_more_pieces_than_a_call_has_phases_is_exact() -> None:
    """A 4 KiB staging budget at 3 ranks makes 1 KiB pieces: 400,000 float32 would need
    over 500 of them, a sync each, more than a call's phase counter holds; the plan makes
    the pieces larger instead (this failed with an AssertionError on one rank)."""
    config = dsml.CommConfig(shm_stage_bytes=4096)
    async with open_local_cluster(3, config=config) as comms:
        xs = [np.arange(400_000, dtype=np.float32) % 97 + r for r in range(3)]
        expected = np.sum(xs, axis=0, dtype=np.float32)
        await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs, strict=True)))
        for x in xs:
            np.testing.assert_array_equal(x, expected)
        assert all(c.stats()[-1]["algorithm"] == "shm" for c in comms)


async def test_a_broadcast_of_more_pieces_than_a_call_has_phases_is_exact() -> None:
    """Broadcast syncs twice per piece of the staging budget: 2 MiB (past the 1 MiB inline
    area) through a 4 KiB stage would take 1024 syncs, more than a call's phase counter
    holds; pieces grow instead."""
    config = dsml.CommConfig(shm_stage_bytes=4096)
    async with open_local_cluster(3, config=config) as comms:
        xs = [np.full(1 << 19, r, np.float32) for r in range(3)]
        xs[2][:] = np.arange(1 << 19) % 101
        await asyncio.gather(*(c.broadcast(x, root=2) for c, x in zip(comms, xs, strict=True)))
        for x in xs:
            np.testing.assert_array_equal(x, np.arange(1 << 19) % 101)
        assert all(c._session.shm.plane.calls == 1 for c in comms)  # in shared memory


@pytest.mark.parametrize(("hosts", "per_host"), [(2, 2), (3, 1), (2, 3)])
async def test_hierarchical_all_reduce_over_hosts_is_exact(
    monkeypatch: pytest.MonkeyPatch, hosts: int, per_host: int
) -> None:
    """Members join in rank order; the first `per_host` say they run on one machine, the
    next on another, ... (host identities faked; their segments all live in this /dev/shm)."""
    init_module = importlib.import_module("dsml.communicator.init")  # the module, not init()
    identities = iter(f"fake{os.getpid()}:{r // per_host}" for r in range(hosts * per_host))
    monkeypatch.setattr(init_module, "host_identity", lambda: next(identities))
    world = hosts * per_host
    async with open_local_cluster(world) as comms:
        assert not comms[0]._session.shm.plane.all_local
        for n, op in [(10, "sum"), (100_003, "max"), (50_000, "avg")]:
            dtype = np.float64 if op == "avg" else np.int64
            xs = [(np.arange(n) % 11 + r).astype(dtype) for r in range(world)]
            expected = {"sum": np.sum, "max": np.max, "avg": np.mean}[op](xs, axis=0)
            await asyncio.gather(
                *(
                    c.all_reduce(x, op, algorithm="hierarchical")
                    for c, x in zip(comms, xs, strict=True)
                )
            )
            for x in xs:
                np.testing.assert_allclose(x, expected, rtol=1e-12)
            assert len({x.tobytes() for x in xs}) == 1  # bitwise identical everywhere
        assert all(c._session.shm.plane.calls == 3 for c in comms)  # the local phases ran


async def test_an_auto_call_that_runs_over_tcp_does_not_hold_up_a_later_hierarchical_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Across hosts with as many ranks each, an auto all_reduce takes a shared-memory turn
    when planned (it might run hierarchical); once `auto` sends it over TCP it gives the
    turn back, so a hierarchical call behind it runs while it is still under way (before,
    it waited for the TCP call to end). Here the TCP call cannot end before the
    hierarchical one has: held, it would time the hierarchical call out."""
    init_module = importlib.import_module("dsml.communicator.init")
    identities = iter(f"fake{os.getpid()}:{r // 2}" for r in range(4))  # 2 hosts x 2 ranks
    monkeypatch.setattr(init_module, "host_identity", lambda: next(identities))
    async with open_local_cluster(4) as comms:
        await asyncio.gather(*(c.all_reduce(np.ones(1024, np.float32)) for c in comms))
        gate = asyncio.Event()
        table = plan_reductions.ALL_REDUCE  # the TCP all_reduce algorithms, by name
        for name, algorithm in list(table.items()):

            async def held(*args: Any, _algorithm: Any = algorithm) -> Any:
                await gate.wait()
                return await _algorithm(*args)

            monkeypatch.setitem(table, name, held)
        small = [np.full(1024, r + 1, np.float32) for r in range(4)]
        large = [np.arange(100_003, dtype=np.float64) * (r + 1) for r in range(4)]
        first = [asyncio.ensure_future(c.all_reduce(x)) for c, x in zip(comms, small, strict=True)]
        second = [
            c.all_reduce(x, algorithm="hierarchical", timeout=5)
            for c, x in zip(comms, large, strict=True)
        ]
        await asyncio.gather(*second)
        assert not any(f.done() for f in first)  # still held: it never blocked the second
        gate.set()
        await asyncio.gather(*first)
    for x in small:
        np.testing.assert_array_equal(x, np.full(1024, 10, np.float32))
    for x in large:
        np.testing.assert_array_equal(x, np.arange(100_003, dtype=np.float64) * 10)


async def test_with_one_rank_per_host_auto_takes_no_shared_memory_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With one rank on each host the hierarchical all_reduce is the ring between hosts,
    so `auto` does not weigh it and takes no turn (taking and giving it back cost each
    call about 15 us per rank, 6% of a 4 KiB call at 1 Gbit); named, it still runs."""
    init_module = importlib.import_module("dsml.communicator.init")
    identities = iter(f"fake{os.getpid()}:{r}" for r in range(3))  # 3 hosts x 1 rank
    monkeypatch.setattr(init_module, "host_identity", lambda: next(identities))
    turns: list[int] = []
    real_take = ShmHook._take_turn

    def take_turn(self: ShmHook) -> bool:
        turns.append(self._table.next_cid)
        return real_take(self)

    monkeypatch.setattr(ShmHook, "_take_turn", take_turn)
    async with open_local_cluster(3) as comms:
        xs = [np.full(1000, r + 1, np.float32) for r in range(3)]
        for _ in range(3):
            await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs, strict=True)))
        assert turns == []
        assert all((x == 54).all() for x in xs)  # 1+2+3 = 6, then 18, then 54
        await asyncio.gather(
            *(c.all_reduce(x, algorithm="hierarchical") for c, x in zip(comms, xs, strict=True))
        )
        assert len(turns) == 3  # one per rank
        assert all((x == 162).all() for x in xs)


@pytest.mark.timeout(60)
async def test_a_peer_crashing_after_two_ranks_wrote_results_leaves_every_input_intact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two ranks reduce an array of several pieces each into their own input (the pair
    schedule), so results land in the caller's array while the call runs; rank 1 crashes
    at its fourth sync, when rank 0 has written three pieces of results. Rank 0's call
    fails with PeerLostError and its array holds its input again, to the last bit."""
    n = 4 * PAIR_PIECE_BYTES // 8 + 3  # float64: 4 pieces and a bit (a 5th, short one)
    assert (1 << 20) < n * 8 <= PAIR_BYTES  # over the inline size: the pair schedule
    xs = [np.arange(n, dtype=np.float64) * (r + 1) + 0.5 for r in range(2)]
    inputs = [x.copy() for x in xs]
    seen: dict[str, Any] = {}
    rank0_there = asyncio.Event()
    real_sync = shm_plane.ShmCall.sync
    cluster: list[Any] = []

    async def sync(self: Any, ok: bool = True) -> bool:
        if cluster and self._phase == 3 and self.rank == 0:
            seen["rank0"] = xs[0].copy()  # rank 0 has reduced pieces 0-2 into its array
            rank0_there.set()
        elif cluster and self._phase == 3 and "crashed" not in seen:
            seen["crashed"] = True
            await rank0_there.wait()
            await crash(cluster[0][1])
            await asyncio.Event().wait()  # a dead process posts nothing more
        return await real_sync(self, ok)

    hb = dsml.RegistryConfig(heartbeat_interval=0.05, heartbeat_timeout=0.5)
    config = dsml.CommConfig(timeout=8, view_timeout=8, join_timeout=10)
    async with open_local_cluster(2, config=config, registry_config=hb) as comms:
        await asyncio.gather(*(c.all_reduce(np.ones(4)) for c in comms))
        monkeypatch.setattr(shm_plane.ShmCall, "sync", sync)
        cluster.append(comms)
        calls = [asyncio.ensure_future(c.all_reduce(x)) for c, x in zip(comms, xs, strict=True)]
        outcome = await asyncio.gather(calls[0], return_exceptions=True)
        await asyncio.wait([calls[1]], timeout=5)
        assert isinstance(outcome[0], dsml.PeerLostError), repr(outcome[0])
    step = PAIR_PIECE_BYTES // 8
    written = seen["rank0"][: 3 * step]
    np.testing.assert_array_equal(written, inputs[0][: 3 * step] + inputs[1][: 3 * step])
    np.testing.assert_array_equal(xs[0], inputs[0])  # every bit back as it was


async def test_a_rank_that_never_arrives_times_out_the_others_and_a_late_one_fails_too() -> None:
    async with open_local_cluster(3) as comms:
        xs = [np.full(1000, r + 1, np.float32) for r in range(3)]
        early = await asyncio.gather(
            *(c.all_reduce(x, timeout=0.5) for c, x in zip(comms[:2], xs[:2], strict=True)),
            return_exceptions=True,
        )
        assert all(isinstance(e, dsml.CollectiveTimeoutError) for e in early), early
        assert any(2 in e.missing for e in early)  # the first to time out names rank 2
        with pytest.raises(dsml.CollectiveError):
            await comms[2].all_reduce(xs[2], timeout=5)
        assert all((x == r + 1).all() for r, x in enumerate(xs))  # inputs intact
        ys = [np.full(3, r, np.int32) for r in range(3)]  # and the group goes on
        await asyncio.gather(*(c.all_reduce(y) for c, y in zip(comms, ys, strict=True)))
        assert all((y == 3).all() for y in ys)
