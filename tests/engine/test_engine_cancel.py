"""Cancelling ops: before they start (removed cleanly) and while they run (poison)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dsml.engine import Engine
from dsml.errors import DependencyFailedError
from tests.engine.helpers import AnyEngine, settle, thread_until, until


class Boom(Exception):
    """The original error of the tests."""


async def test_a_pending_op_cancelled_never_runs_and_its_handle_raises(
    any_engine: AnyEngine,
) -> None:
    a = any_engine.new_var("a")
    gate = asyncio.Event()
    ran: list[str] = []
    any_engine.push(lambda: until(gate), mutate=[a])
    victim = any_engine.push(lambda: ran.append("victim"), mutate=[a])
    waiter = asyncio.create_task(_await(victim))
    await asyncio.sleep(0)  # the waiter now blocks on the handle
    assert victim.cancel() is True
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiter, 5)  # woken at once, not when the gate opens
    assert victim.cancelled()
    assert victim.done()
    assert victim.status == "cancelled"
    assert victim.cancel() is False  # once is enough
    gate.set()
    await any_engine.wait_all()
    with pytest.raises(asyncio.CancelledError):
        await victim
    assert ran == []
    assert any_engine.statistics()["cancelled"] == 1


async def test_ops_behind_a_cancelled_op_wait_for_what_it_waited_for(engine: Engine) -> None:
    a = engine.new_var("a")
    gate = asyncio.Event()
    log: list[str] = []

    async def first() -> None:
        await until(gate)
        log.append("first")

    engine.push(first, mutate=[a])
    engine.push(lambda: log.append("cancelled"), mutate=[a]).cancel()
    reader = engine.push(lambda: log.append("reader"), read=[a])
    writer = engine.push(lambda: log.append("writer"), mutate=[a])
    await settle(engine)
    assert (reader.status, writer.status) == ("pending", "pending")
    gate.set()
    await engine.wait_var(a)
    assert log == ["first", "reader", "writer"]


async def test_a_cancelled_op_poisons_nothing_but_passes_earlier_poison_on(
    any_engine: AnyEngine,
) -> None:
    a, b = any_engine.new_var("a"), any_engine.new_var("b")

    def fail() -> None:
        raise Boom("root")

    gate = asyncio.Event()
    any_engine.push(lambda: until(gate), mutate=[b])
    any_engine.push(fail, mutate=[a])
    # Would fail (it mutates a poisoned var and b); cancelled, it changes nothing.
    any_engine.push(lambda: None, read=[a], mutate=[a, b]).cancel()
    on_a = any_engine.push(lambda: "a", read=[a])
    on_b = any_engine.push(lambda: "b", read=[b])
    gate.set()
    with pytest.raises(DependencyFailedError) as info:
        await on_a
    assert isinstance(info.value.__cause__, Boom)
    assert await on_b == "b"


async def test_cancelling_a_running_coroutine_op_cancels_it_and_poisons_its_vars(
    any_engine: AnyEngine,
) -> None:
    a = any_engine.new_var("a")
    started, seen = asyncio.Event(), asyncio.Event()

    async def long_running() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.set()
            raise

    op = any_engine.push(long_running, mutate=[a], name="long")
    reader = any_engine.push(lambda: "reader ran", read=[a])
    await until(started)
    assert op.cancel() is True
    with pytest.raises(asyncio.CancelledError):
        await op
    assert seen.is_set()
    assert op.cancelled()
    with pytest.raises(DependencyFailedError) as info:
        await asyncio.wait_for(asyncio.shield(reader), 5)  # a dependent never hangs
    assert isinstance(info.value.__cause__, asyncio.CancelledError)
    assert "'long'" in str(info.value)
    with pytest.raises(DependencyFailedError):
        await any_engine.wait_var(a)
    # The reader's failure was reported by awaiting it, and the cancellation is no failure
    await any_engine.wait_all()


async def test_a_coroutine_op_cancelled_before_its_body_ran_poisons_nothing(
    engine: Engine,
) -> None:
    a = engine.new_var("a")
    ran: list[str] = []

    async def body() -> None:
        ran.append("body")

    op = engine.push(body, mutate=[a])
    assert op.status == "running"  # nothing to wait for: its task exists already
    assert op.cancel() is True
    after = engine.push(lambda: "after", read=[a])
    assert await after == "after"
    assert ran == []
    assert op.cancelled()
    await engine.wait_var(a)


async def test_a_plain_function_running_in_a_thread_cannot_be_cancelled(engine: Engine) -> None:
    entered, release = threading.Event(), threading.Event()

    def work() -> str:
        entered.set()
        thread_until(release)
        return "finished"

    op = engine.push(work)
    assert await asyncio.to_thread(entered.wait, 5)
    assert op.cancel() is False
    release.set()
    assert await op == "finished"
    assert op.cancel() is False  # done: nothing to cancel


async def test_a_cancelled_waiter_does_not_cancel_the_op(any_engine: AnyEngine) -> None:
    gate = asyncio.Event()

    async def work() -> str:
        await until(gate)
        return "done"

    op = any_engine.push(work)
    waiter = asyncio.create_task(_await(op))
    await asyncio.sleep(0)  # let the waiter block on the handle
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(_await(op), 0.01)  # a timed-out wait leaves the op alone
    gate.set()
    assert await op == "done"


async def test_leaving_async_with_on_an_error_cancels_pending_ops() -> None:
    ran: list[str] = []
    gate = asyncio.Event()
    engine = Engine(name="leaving")
    handles = []

    async def body() -> None:
        async with engine:
            a = engine.new_var("a")
            handles.append(engine.push(lambda: until(gate), mutate=[a]))
            handles.append(engine.push(lambda: ran.append("pending"), mutate=[a]))
            raise Boom("user code failed")

    with pytest.raises(Boom):
        await body()
    assert [h.cancelled() for h in handles] == [True, True]
    assert ran == []
    assert engine.closed


async def _await(op: asyncio.Future[str] | object) -> object:
    return await op  # type: ignore[misc]


async def test_a_plain_function_waiting_for_a_free_pool_thread_can_be_cancelled() -> None:
    """With every pool thread busy, a queued op said 'running' and cancel() gave False."""
    engine = Engine(max_workers=1, name="one-thread")
    try:
        gate = threading.Event()
        busy = engine.push(gate.wait)
        ran: list[int] = []
        queued = engine.push(lambda: ran.append(1))
        await asyncio.sleep(0.05)  # both handed to the pool; the second waits for a thread
        assert queued.cancel() is True
        assert queued.cancelled()
        gate.set()
        await busy
        await engine.wait_all()
        assert ran == []
    finally:
        gate.set()
        await engine.aclose()
