"""comm.stats(), the per-collective debug line, and the trace of collectives and engine ops."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import numpy as np
import pytest

from dsml import CollectiveMismatchError, CommConfig, log
from dsml.testing import open_local_cluster

SPLIT = ("waiting_s", "wire_s", "reduce_s", "copy_s", "other_s")


@pytest.fixture
def debug_lines():
    """dsml's log at debug level into a string; the previous setup restored after."""
    logger = logging.getLogger("dsml")
    saved = (logger.level, list(logger.handlers), logger.propagate)
    stream = io.StringIO()
    log.configure("debug", stream=stream)
    yield stream
    logger.setLevel(saved[0])
    logger.handlers[:] = saved[1]
    logger.propagate = saved[2]


async def test_stats_lists_each_call_with_its_size_algorithm_and_a_split_that_adds_up():
    async with open_local_cluster(3) as cluster:

        async def calls(comm):
            x = np.ones(1 << 16, dtype=np.float32)  # 256 KiB
            await comm.all_reduce(x, algorithm="ring")
            await comm.broadcast(np.zeros(10), root=1)
            return comm.stats()

        everyone = await cluster.run(calls)
    for stats in everyone:
        ring, bcast = stats[-2:]
        assert (ring["kind"], ring["bytes"], ring["algorithm"], ring["outcome"]) == (
            "all_reduce",
            1 << 18,
            "ring",
            "ok",
        )
        assert (bcast["kind"], bcast["bytes"], bcast["outcome"]) == ("broadcast", 80, "ok")
        for record in (ring, bcast):
            assert all(0 <= record[k] <= record["total_s"] for k in SPLIT), record
            parts = sum(record[k] for k in SPLIT[:-1])
            assert record["other_s"] == pytest.approx(max(0.0, record["total_s"] - parts))
        assert ring["reduce_s"] > 0  # every rank reduces a segment in the ring
        assert ring["copy_s"] > 0  # and copies the others' segments into its result


async def test_row_collectives_record_this_ranks_input_size_even_when_ranks_differ():
    """all_gather, gather and all_to_all leave the first axis out of the fingerprint (ranks
    may differ there); their stats still give each rank's own input size."""
    async with open_local_cluster(2) as cluster:

        async def calls(comm):
            rows = 2 + comm.rank  # 2 rows on rank 0, 3 on rank 1
            await comm.all_gather(np.ones((rows, 4), dtype=np.float32))
            await comm.gather(np.ones((rows, 4), dtype=np.float64), root=0)
            await comm.all_to_all(np.ones((2, 3), dtype=np.int16))
            return comm.stats()[-3:]

        everyone = await cluster.run(calls)
    for rank, stats in enumerate(everyone):
        got = [(r["kind"], r["bytes"], r["outcome"]) for r in stats]
        assert got == [
            ("all_gather", (2 + rank) * 4 * 4, "ok"),
            ("gather", (2 + rank) * 4 * 8, "ok"),
            ("all_to_all", 2 * 3 * 2, "ok"),
        ]


async def test_a_late_rank_shows_up_as_time_waiting_for_peers():
    async with open_local_cluster(2) as cluster:

        async def late(comm):
            if comm.rank == 1:
                await asyncio.sleep(0.3)
            await comm.all_reduce(np.ones(4))
            return comm.stats()[-1]

        early, _ = await cluster.run(late)
    assert early["waiting_s"] >= 0.2
    assert early["waiting_s"] <= early["total_s"]


async def test_a_failed_call_is_recorded_with_its_error():
    async with open_local_cluster(2) as cluster:
        outcomes = await asyncio.gather(
            *(c.all_reduce(np.ones(3 + c.rank)) for c in cluster), return_exceptions=True
        )
        assert all(isinstance(o, CollectiveMismatchError) for o in outcomes)
        assert [c.stats()[-1]["outcome"] for c in cluster] == ["CollectiveMismatchError"] * 2


async def test_debug_logging_shows_one_line_per_collective_with_rank_and_epoch(debug_lines):
    async with open_local_cluster(2) as cluster:
        for _ in range(3):
            await cluster.run(lambda c: c.all_reduce(np.ones(4)))
        await cluster.run(lambda c: c.barrier())
    lines = [line for line in debug_lines.getvalue().splitlines() if "dsml.communicator" in line]
    for rank in (0, 1):
        mine = [line for line in lines if f"[rank {rank} epoch 1]" in line]
        assert [line.split("] ", 1)[1].split(" (")[0] for line in mine] == [
            "all_reduce #1",
            "all_reduce #2",
            "all_reduce #3",
            "barrier #4",
        ], lines
        assert all(" ok in " in line and "waiting" in line for line in mine)


async def test_the_trace_holds_collectives_and_engine_ops_on_one_timeline(tmp_path):
    async with open_local_cluster(2, config=CommConfig(engine_trace=True)) as cluster:

        async def work(comm):
            grads = comm.engine.new_var("grads")
            x = np.ones(1000)
            comm.engine.push(lambda: x.__imul__(2), mutate=[grads])
            comm.engine.push(lambda: comm.all_reduce(x), read=[], mutate=[grads, comm.var])
            await comm.engine.wait_all()
            return x

        results = await cluster.run(work)
        assert all((x == 4).all() for x in results)
        path = tmp_path / "rank0.json"
        cluster[0].write_trace(path)
        trace = json.loads(path.read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    collectives = [e for e in slices if e["cat"] == "collectives"]
    assert [e["name"] for e in collectives] == ["all_reduce #1"]
    assert collectives[0]["args"]["outcome"] == "ok"
    assert {"waiting_s", "wire_s", "reduce_s", "copy_s"} <= set(collectives[0]["args"])
    assert {e["cat"] for e in slices} >= {"pool", "loop", "collectives"}
    # One clock: the all_reduce starts after the pool ran the op that issued it, and ends
    # before the loop finished awaiting it (1 ms of slack for rounding and scheduling).
    issued = min(e["ts"] for e in slices if e["cat"] == "pool")
    awaited = max(e["ts"] + e["dur"] for e in slices if e["cat"] == "loop")
    call = collectives[0]
    assert issued - 1e3 <= call["ts"] <= call["ts"] + call["dur"] <= awaited + 1e3


async def test_collectives_made_before_the_engine_existed_get_no_negative_time():
    # Perfetto refuses ts < 0: time 0 is the earliest span when one began before the engine.
    async with open_local_cluster(2, config=CommConfig(engine_trace=True)) as cluster:

        async def work(comm):
            await comm.all_reduce(np.ones(8))  # the engine is made after this
            await asyncio.sleep(0.01)
            comm.push_all_reduce(comm.engine.tag("g", np.ones(4)))
            await comm.engine.wait_all()
            return comm.trace()

        trace = (await cluster.run(work))[0]
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in slices if e["cat"] == "collectives"][:1] == ["all_reduce #1"]
    assert min(e["ts"] for e in slices) == 0.0


async def test_collectives_are_torch_profiler_spans_when_torch_is_imported():
    """One rank, as in a training process (the profiler nests spans per thread, so the
    interleaved calls of several in-process ranks are not what it is for)."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install dsml[torch])")
    async with open_local_cluster(1) as cluster:
        comm = cluster[0]
        with torch.profiler.profile() as profile:
            await comm.all_reduce(np.ones(4))
            await comm.broadcast(np.ones(4))
    names = [event.name for event in profile.events()]
    assert names.count("dsml::all_reduce") == 1, names
    assert names.count("dsml::broadcast") == 1, names
