"""What an engine tells about itself: statistics, reprs, handle states, trace files."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from dsml.engine import Engine
from dsml.errors import ConfigError
from tests.engine.helpers import AnyEngine, until


class Boom(Exception):
    """The original error of the tests."""


def fail() -> None:
    raise Boom("x")


async def test_statistics_count_ops_by_state(any_engine: AnyEngine) -> None:
    a = any_engine.new_var("a")
    started, gate = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        started.set()
        await until(gate)

    any_engine.push(hold, mutate=[a])
    any_engine.push(fail, mutate=[a])
    any_engine.push(lambda: None, read=[a]).cancel()
    any_engine.push(lambda: None, read=[a])
    await until(started)
    assert any_engine.statistics() == {
        "pushed": 4, "pending": 2, "running": 1, "done": 0, "failed": 0, "cancelled": 1,
        "vars": 1,
    }  # fmt: skip
    gate.set()
    with pytest.raises(Boom):
        await any_engine.wait_all()
    stats = any_engine.statistics()
    assert (stats["pending"], stats["running"], stats["done"]) == (0, 0, 1)
    assert (stats["failed"], stats["cancelled"]) == (2, 1)


async def test_reprs_show_names_states_and_vars(engine: Engine) -> None:
    a, b = engine.new_var("weights"), engine.new_var("grads")
    gate = asyncio.Event()
    op = engine.push(lambda: until(gate), read=[b], mutate=[a], name="update")
    later = engine.push(lambda: None, read=[a], name="read-back")
    text = repr(op)
    assert "'update'" in text
    assert "read=[grads]" in text
    assert "mutate=[weights]" in text
    assert "running" in text
    assert "pending" in repr(later)
    assert "'test-engine'" in repr(engine)
    assert "pushed=2" in repr(engine)
    assert "'weights'" in repr(a)
    assert f"writer=#{op.seq}" in repr(a)
    gate.set()
    await engine.wait_all()
    assert "succeeded" in repr(op)
    assert "done=2" in repr(engine)


async def test_handle_methods_follow_the_op_state(engine: Engine) -> None:
    gate = asyncio.Event()
    op = engine.push(lambda: until(gate))
    bad = engine.push(fail)
    with pytest.raises(asyncio.InvalidStateError):
        op.result()
    with pytest.raises(asyncio.InvalidStateError):
        op.exception()
    gate.set()
    assert await op is None
    assert op.exception() is None
    with pytest.raises(Boom):
        await bad
    assert isinstance(bad.exception(), Boom)
    assert bad.status == "failed"
    with pytest.raises(Boom):
        bad.result()
    await engine.wait_all()  # reported through its handle already: not raised again


async def test_the_trace_file_has_one_event_per_op_phase_on_separate_tracks(
    tmp_path: Path,
) -> None:
    async with Engine(trace=True, name="traced") as engine:
        a, b = engine.new_var("a"), engine.new_var("b")
        started = [asyncio.Event(), asyncio.Event()]

        async def overlap(me: int) -> None:
            started[me].set()
            await until(started[1 - me])

        engine.push(lambda: sum(range(1000)), mutate=[a], name="compute")
        engine.push(lambda: overlap(0), read=[a], mutate=[b], name="comm")
        engine.push(lambda: overlap(1), read=[a], name="comm-2")
        engine.push(fail, mutate=[b], name="fails")
        with pytest.raises(Boom):
            await engine.wait_all()
        path = tmp_path / "engine.perfetto.json"
        engine.write_trace(path)
    trace = json.loads(path.read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    by_name: dict[str, list[dict[str, Any]]] = {}
    for event in slices:
        by_name.setdefault(event["name"], []).append(event)
        assert event["dur"] >= 0
        assert event["ts"] >= 0
        assert event["pid"] == 1
    assert sorted(by_name) == ["comm", "comm-2", "compute", "fails"]
    assert [e["cat"] for e in by_name["compute"]] == ["pool"]
    assert sorted(e["cat"] for e in by_name["comm"]) == ["loop", "pool"]
    assert by_name["fails"][0]["args"]["outcome"] == "failed"
    loop_tids = {e["tid"] for e in slices if e["cat"] == "loop"}
    pool_tids = {e["tid"] for e in slices if e["cat"] == "pool"}
    assert len(loop_tids) == 2, "the overlapping awaits need two lanes"
    assert not loop_tids & pool_tids
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert "event loop, lane 1" in names
    assert "pool thread 1" in names


def test_write_trace_without_tracing_says_how_to_turn_it_on(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trace=True"):
        Engine().write_trace(tmp_path / "t.json")


async def test_a_communicators_engine_traces_when_asked_and_says_how_otherwise() -> None:
    import numpy as np

    import dsml
    from dsml.testing import open_local_cluster

    traced = dsml.CommConfig(engine_trace=True, timeout=10)
    async with open_local_cluster(2, config=traced) as cluster:

        async def step(comm: dsml.Communicator) -> None:
            x = np.ones(4)
            comm.engine.push(lambda: comm.all_reduce(x), mutate=[comm.var], name="allreduce")
            await comm.engine.wait_all()

        await cluster.run(step)
        trace = cluster[0].engine.trace()
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert "allreduce" in names

    async with open_local_cluster(1) as cluster:
        with pytest.raises(dsml.ConfigError, match="CommConfig\\(engine_trace=True\\)"):
            cluster[0].engine.trace()
