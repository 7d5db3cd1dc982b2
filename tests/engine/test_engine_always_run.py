"""Ops pushed with always_run take their turn even behind a poisoned var."""

from __future__ import annotations

import pytest

from dsml import DependencyFailedError
from dsml.engine import Engine, SerialEngine


async def test_an_always_run_op_runs_behind_a_failure_and_cleans_what_it_mutates(
    any_engine: Engine | SerialEngine,
) -> None:
    turn = any_engine.new_var("turn")
    log: list[str] = []

    def fail() -> None:
        raise RuntimeError("boom")

    failed = any_engine.push(fail, mutate=[turn], name="fails")
    skipped = any_engine.push(lambda: log.append("plain"), mutate=[turn], name="plain")
    taken = any_engine.push(lambda: log.append("always"), mutate=[turn], always_run=True)
    after = any_engine.push(lambda: log.append("after"), read=[turn], name="after")
    with pytest.raises(RuntimeError):
        await failed
    with pytest.raises(DependencyFailedError):
        await skipped
    await taken
    await after
    assert log == ["always", "after"]
    assert isinstance(taken.blocked, DependencyFailedError)  # it knew what it ran past
    assert isinstance(taken.blocked.__cause__, RuntimeError)
    await any_engine.wait_var(turn)  # clean again


async def test_an_always_run_coroutine_cancelled_before_its_body_keeps_the_poison_it_met(
    any_engine: Engine | SerialEngine,
) -> None:
    """Cancelled right after it was started, before its body ran, it passes the earlier
    failure on as a cancelled pending op does (the threaded engine forgot it)."""
    v = any_engine.new_var("v")

    def boom() -> None:
        raise RuntimeError("boom")

    async def body() -> None:
        pass

    failed = any_engine.push(boom, mutate=[v])
    with pytest.raises(RuntimeError):
        await failed
    op = any_engine.push(body, mutate=[v], always_run=True)
    assert op.cancel()
    reader = any_engine.push(lambda: 1, read=[v])
    with pytest.raises(DependencyFailedError):
        await reader
    with pytest.raises(DependencyFailedError):
        await any_engine.wait_var(v)
