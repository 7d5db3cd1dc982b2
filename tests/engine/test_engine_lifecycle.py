"""Creating, using wrongly, and closing engines."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dsml.engine import Engine, SerialEngine
from dsml.errors import ConfigError
from tests.engine.helpers import AnyEngine, thread_until


def test_creating_an_engine_needs_no_loop_and_starts_no_threads() -> None:
    before = threading.active_count()
    engine = Engine(max_workers=2, name="quiet")
    assert threading.active_count() == before
    assert engine.statistics()["pushed"] == 0
    assert not engine.closed


@pytest.mark.parametrize("workers", [0, -1, 1.5, "2"])
def test_a_bad_max_workers_is_a_config_error(workers: object) -> None:
    with pytest.raises(ConfigError, match="max_workers"):
        Engine(max_workers=workers)  # type: ignore[arg-type]


async def test_pushing_after_aclose_raises(any_engine: AnyEngine) -> None:
    await any_engine.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        any_engine.push(lambda: None)


async def test_a_var_of_another_engine_is_a_config_error(any_engine: AnyEngine) -> None:
    foreign = SerialEngine(name="other").new_var("x")
    with pytest.raises(ConfigError, match="belongs to engine 'other'"):
        any_engine.push(lambda: None, read=[foreign])
    with pytest.raises(ConfigError, match="belongs to engine 'other'"):
        any_engine.push(lambda: None, mutate=[foreign])
    with pytest.raises(ConfigError):
        await any_engine.wait_var(foreign)
    with pytest.raises(ConfigError):
        any_engine.clear_error(foreign)
    assert any_engine.statistics()["pushed"] == 0


async def test_wrong_arguments_to_push_are_config_errors(any_engine: AnyEngine) -> None:
    a = any_engine.new_var("a")
    with pytest.raises(ConfigError, match="list of vars"):
        any_engine.push(lambda: None, read=a)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="new_var"):
        any_engine.push(lambda: None, mutate=["a"])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="callable"):
        any_engine.push(42)  # type: ignore[call-overload]
    coroutine = asyncio.sleep(0)
    with pytest.raises(ConfigError, match="coroutine object"):
        any_engine.push(coroutine)  # type: ignore[call-overload]
    assert coroutine.cr_frame is None  # closed: no "never awaited" warning later
    assert any_engine.statistics()["pushed"] == 0


async def test_push_from_another_thread_is_refused(engine: Engine) -> None:
    with pytest.raises(RuntimeError, match="event loop"):
        await asyncio.to_thread(engine.push, lambda: None)


async def test_aclose_waits_for_running_and_pending_ops_then_stops_the_pool() -> None:
    engine = Engine(max_workers=2, name="closing")
    a = engine.new_var("a")
    release = threading.Event()
    log: list[str] = []
    engine.push(lambda: log.append("first" if thread_until(release) else "timeout"), mutate=[a])
    engine.push(lambda: log.append("second"), mutate=[a])
    closing = asyncio.create_task(engine.aclose())
    await asyncio.sleep(0)
    assert not closing.done()
    assert engine.closed
    release.set()
    await asyncio.wait_for(closing, 5)
    assert log == ["first", "second"]
    assert not [t for t in threading.enumerate() if t.name.startswith("dsml-closing")]
    await engine.aclose()  # closing twice is harmless


async def test_an_engine_is_an_async_context_manager(any_engine: AnyEngine) -> None:
    async with any_engine as same:
        result = same.push(lambda: "ran")
    assert any_engine.closed
    assert await result == "ran"
