"""Where each kind of `fn` runs: pool thread, event loop, or both."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator, Generator
from typing import Any

import pytest

from dsml.engine import Engine
from dsml.errors import ConfigError, DependencyFailedError
from tests.engine.helpers import thread_until, until


async def test_a_plain_function_runs_in_a_pool_thread_not_the_loop_thread(engine: Engine) -> None:
    op = engine.push(threading.current_thread)
    thread = await op
    assert thread is not threading.current_thread()
    assert thread.name.startswith("dsml-test-engine")


async def test_a_plain_function_does_not_block_the_event_loop(engine: Engine) -> None:
    release = threading.Event()
    blocked = engine.push(lambda: thread_until(release))
    # The loop is free while the function blocks: it can run this coroutine op meanwhile.
    flag = await engine.push(lambda: asyncio.sleep(0, result="loop ran"))
    release.set()
    assert (flag, await blocked) == ("loop ran", True)


async def test_a_coroutine_function_runs_on_the_loop_thread(engine: Engine) -> None:
    async def where() -> threading.Thread:
        return threading.current_thread()

    assert await engine.push(where) is threading.current_thread()


async def test_a_partial_of_a_coroutine_function_runs_on_the_loop_thread(engine: Engine) -> None:
    async def where(tag: str) -> tuple[str, threading.Thread]:
        return tag, threading.current_thread()

    assert await engine.push(functools.partial(where, "p")) == ("p", threading.current_thread())


async def test_an_object_with_async_call_runs_on_the_loop_thread(engine: Engine) -> None:
    class Where:
        async def __call__(self) -> threading.Thread:
            return threading.current_thread()

    assert await engine.push(Where()) is threading.current_thread()


async def test_a_coroutine_returned_by_a_plain_function_is_awaited_on_the_loop(
    engine: Engine,
) -> None:
    loop_thread = threading.current_thread()

    def start() -> Any:
        called_in = threading.current_thread()

        async def finish() -> tuple[bool, bool]:
            return called_in is not loop_thread, threading.current_thread() is loop_thread

        return finish()

    assert await engine.push(start) == (True, True)


async def test_an_op_returning_a_future_finishes_when_the_future_does() -> None:
    async with Engine(max_workers=1) as engine:  # one thread: completions come back in order
        a = engine.new_var("a")
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        op = engine.push(lambda: future, mutate=[a])
        after = engine.push(lambda: "after", read=[a])
        await engine.push(lambda: None)  # `op`'s function has returned the future by now
        assert op.status == "running"
        assert after.status == "pending"
        future.set_result("collective done")
        assert (await op, await after) == ("collective done", "after")


async def test_any_object_with_await_is_awaited(engine: Engine) -> None:
    class Handle:
        def __await__(self) -> Generator[Any, None, str]:
            yield from asyncio.sleep(0).__await__()
            return "awaited"

    assert await engine.push(Handle) == "awaited"


async def test_the_result_is_available_from_the_handle(engine: Engine) -> None:
    gate = asyncio.Event()

    async def compute() -> int:
        await until(gate)
        return 42

    op = engine.push(compute, name="answer")
    assert op.name == "answer"
    assert not op.done()
    gate.set()
    assert await op == 42
    assert (op.done(), op.result(), op.exception()) == (True, 42, None)


async def test_bad_var_lists_and_async_generator_functions_are_config_errors(
    engine: Engine,
) -> None:
    with pytest.raises(ConfigError, match="list of vars"):
        engine.push(lambda: None, read=None)  # type: ignore[arg-type]

    async def agen() -> AsyncIterator[int]:
        yield 1

    with pytest.raises(ConfigError, match="async generator"):
        engine.push(agen)  # calling it runs nothing: it "succeeded" without running


async def test_an_op_that_waits_for_itself_gets_a_config_error_not_a_hang(
    any_engine: Any,
) -> None:
    v, w = any_engine.new_var("v"), any_engine.new_var("w")

    async def waits_for_all() -> None:
        await any_engine.wait_all()

    async def waits_for_its_var() -> None:
        await any_engine.wait_var(w)

    for fn, var in ((waits_for_all, v), (waits_for_its_var, w)):
        op = any_engine.push(fn, mutate=[var])
        with pytest.raises(ConfigError, match="waits for the op itself"):
            await asyncio.wait_for(asyncio.shield(op), 5)  # it hung for good


@pytest.mark.parametrize("chain", [1, 2], ids=["direct", "through-another-op"])
async def test_an_op_waiting_for_a_later_op_that_waits_for_it_gets_a_config_error(
    engine: Engine, chain: int
) -> None:
    """`a` mutates v, then waits for w; w's writer `b` was pushed after `a` and reads v
    (or reads what an op reading v wrote): `b` cannot start before `a` ends, so the wait
    would hang for good. A wait for a later op that does not depend on `a` still works."""
    v, u, w, free = (engine.new_var(n) for n in ("v", "u", "w", "free"))
    gate = asyncio.Event()

    async def a() -> str:
        await gate.wait()
        await engine.wait_var(free)  # its writer does not wait for `a`: fine
        await engine.wait_var(w)
        return "never"

    op = engine.push(a, mutate=[v], name="a")
    engine.push(lambda: None, mutate=[free], name="independent")
    if chain == 1:
        engine.push(lambda: None, read=[v], mutate=[w], name="b")
    else:
        engine.push(lambda: None, read=[v], mutate=[u], name="c")
        engine.push(lambda: None, read=[u], mutate=[w], name="b")
    gate.set()
    with pytest.raises(ConfigError, match="waits for op 'b', but that op waits for 'a'"):
        await asyncio.wait_for(asyncio.shield(op), 5)  # it hung for good
    # ... and the ops behind it end too: `b` met a's failure as poison on v
    with pytest.raises(DependencyFailedError, match="op 'a' failed with ConfigError"):
        await asyncio.wait_for(engine.wait_var(w), 5)
