"""Ordering rules of the threaded engine, shown with event handshakes (no sleeps)."""

from __future__ import annotations

import asyncio
import functools
import threading

from dsml.engine import Engine, SerialEngine
from tests.engine.helpers import settle, thread_until, until


async def test_reader_waits_for_the_earlier_writer_and_sees_its_value(engine: Engine) -> None:
    a = engine.new_var("a")
    gate = asyncio.Event()
    data: dict[str, int] = {}

    async def write() -> None:
        await until(gate)
        data["a"] = 2

    engine.push(write, mutate=[a])
    reader = engine.push(lambda: data["a"] + 1, read=[a])
    await settle(engine)
    assert reader.status == "pending"
    gate.set()
    assert await reader == 3


async def test_writer_waits_for_earlier_readers(engine: Engine) -> None:
    a = engine.new_var("a")
    gate = asyncio.Event()
    data = {"a": 1}

    async def read() -> int:
        await until(gate)
        return data["a"]

    readers = [engine.push(read, read=[a]) for _ in range(2)]
    writer = engine.push(lambda: data.update(a=2), mutate=[a])
    await settle(engine)
    assert writer.status == "pending"
    gate.set()
    assert [await r for r in readers] == [1, 1]
    await writer
    assert data["a"] == 2


async def test_writes_to_one_var_happen_in_push_order(engine: Engine) -> None:
    a = engine.new_var("a")
    gate = asyncio.Event()
    log: list[int] = []

    async def first() -> None:
        await until(gate)
        log.append(1)

    engine.push(first, mutate=[a])
    second = engine.push(lambda: log.append(2), mutate=[a])
    third = engine.push(lambda: log.append(3), read=[a], mutate=[a])
    await settle(engine)
    assert (second.status, third.status) == ("pending", "pending")
    gate.set()
    await engine.wait_var(a)
    assert log == [1, 2, 3]


async def test_readers_of_one_var_run_together_on_the_loop(engine: Engine) -> None:
    a = engine.new_var("a")
    started = [asyncio.Event(), asyncio.Event()]

    async def reader(me: int) -> None:  # would time out if the readers were serialized
        started[me].set()
        await until(started[1 - me])

    handles = [engine.push(functools.partial(reader, i), read=[a]) for i in range(2)]
    await asyncio.gather(*handles)
    assert all(h.status == "succeeded" for h in handles)


async def test_readers_of_one_var_run_together_in_the_pool(engine: Engine) -> None:
    a = engine.new_var("a")
    started = [threading.Event(), threading.Event()]

    def reader(me: int) -> bool:
        started[me].set()
        return thread_until(started[1 - me])

    handles = [engine.push(lambda i=i: reader(i), read=[a]) for i in range(2)]
    assert [await h for h in handles] == [True, True]


async def test_ops_mutating_different_vars_overlap(engine: Engine) -> None:
    a, b = engine.new_var("a"), engine.new_var("b")
    started = [threading.Event(), threading.Event()]

    def work(me: int) -> bool:
        started[me].set()
        return thread_until(started[1 - me])

    first = engine.push(lambda: work(0), mutate=[a])
    second = engine.push(lambda: work(1), mutate=[b])
    assert [await first, await second] == [True, True]


async def test_ops_sharing_no_mutated_var_run_concurrently(engine: Engine) -> None:
    shared, a, b = engine.new_var("shared"), engine.new_var("a"), engine.new_var("b")
    started = [asyncio.Event(), asyncio.Event()]

    async def work(me: int) -> None:
        started[me].set()
        await until(started[1 - me])

    first = engine.push(lambda: work(0), read=[shared], mutate=[a])
    second = engine.push(lambda: work(1), read=[shared], mutate=[b])
    await asyncio.gather(first, second)
    assert first.done()
    assert second.done()


async def test_ops_without_vars_run_concurrently(engine: Engine) -> None:
    started = [threading.Event(), threading.Event()]

    def work(me: int) -> bool:
        started[me].set()
        return thread_until(started[1 - me])

    handles = [engine.push(lambda i=i: work(i)) for i in range(2)]
    assert [await h for h in handles] == [True, True]


async def test_a_var_both_read_and_mutated_counts_as_mutated(engine: Engine) -> None:
    a = engine.new_var("a")
    gate = asyncio.Event()
    log: list[str] = []

    async def first() -> None:
        await until(gate)
        log.append("first")

    engine.push(first, read=[a], mutate=[a])
    second = engine.push(lambda: log.append("second"), read=[a], mutate=[a])
    assert second.reads == ()
    assert second.mutates == (a,)
    await settle(engine)
    assert second.status == "pending"
    gate.set()
    await engine.wait_all()
    assert log == ["first", "second"]


async def test_duplicate_vars_in_the_lists_are_harmless(engine: Engine) -> None:
    a, b = engine.new_var("a"), engine.new_var("b")
    op = engine.push(lambda: 1, read=[a, a, b], mutate=[b, b])
    assert op.reads == (a,)
    assert op.mutates == (b,)
    after = engine.push(lambda: 2, read=[b, b], mutate=[a, a, a])
    assert (await op, await after) == (1, 2)


async def test_pushes_naming_vars_in_opposite_orders_do_not_deadlock(engine: Engine) -> None:
    a, b = engine.new_var("a"), engine.new_var("b")
    log: list[int] = []
    for i in range(50):
        vars_ = [a, b] if i % 2 else [b, a]
        engine.push(lambda i=i: log.append(i), read=vars_[:1], mutate=vars_[1:])
    await asyncio.wait_for(engine.wait_all(), 10)
    assert sorted(log) == list(range(50))


async def test_wait_var_waits_for_readers_and_writers_of_that_var_only(engine: Engine) -> None:
    a, b = engine.new_var("a"), engine.new_var("b")
    gate_a, gate_b = asyncio.Event(), asyncio.Event()
    reader_a = engine.push(lambda: until(gate_a), read=[a])
    writer_b = engine.push(lambda: until(gate_b), mutate=[b])
    waiting = asyncio.create_task(engine.wait_var(a))
    gate_a.set()
    await asyncio.wait_for(waiting, 5)
    assert reader_a.done()
    assert not writer_b.done()
    gate_b.set()
    await engine.wait_all()
    assert writer_b.done()


async def test_the_serial_engine_runs_one_op_at_a_time_in_push_order() -> None:
    engine = SerialEngine()
    log: list[str] = []

    async def slow() -> None:
        log.append("slow starts")
        for _ in range(5):
            await asyncio.sleep(0)  # a threaded engine would start `fast` meanwhile
        log.append("slow ends")

    engine.push(slow)
    engine.push(lambda: log.append("fast"))
    await engine.wait_all()
    await engine.aclose()
    assert log == ["slow starts", "slow ends", "fast"]
