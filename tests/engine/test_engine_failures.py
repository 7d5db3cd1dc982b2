"""Failures poison the vars an op mutates; DependencyFailedError carries the cause.

Most tests run on both engines (`any_engine`): the threaded one and the serial reference.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from dsml.engine import Engine
from dsml.errors import DependencyFailedError, DsmlError
from tests.engine.helpers import AnyEngine, until


class Boom(Exception):
    """The original error of the tests."""


def fail_plain() -> None:
    raise Boom("plain")


async def fail_coro() -> None:
    raise Boom("coro")


def fail_returned_awaitable() -> Awaitable[None]:
    return fail_coro()


@pytest.mark.parametrize("failing", [fail_plain, fail_coro, fail_returned_awaitable])
async def test_a_failed_op_poisons_what_it_mutates_and_later_users_do_not_run(
    any_engine: AnyEngine, failing: Callable[[], Any]
) -> None:
    a = any_engine.new_var("a")
    ran: list[str] = []
    bad = any_engine.push(failing, mutate=[a], name="bad")
    reader = any_engine.push(lambda: ran.append("reader"), read=[a], name="reader")
    writer = any_engine.push(lambda: ran.append("writer"), mutate=[a], name="writer")
    with pytest.raises(Boom):
        await bad
    for op in (reader, writer):
        with pytest.raises(DependencyFailedError) as info:
            await op
        assert isinstance(info.value.__cause__, Boom)
        assert "'a'" in str(info.value)
        assert "'bad'" in str(info.value)
    assert ran == []
    assert isinstance(info.value, DsmlError)


async def test_poison_propagates_along_a_chain_with_the_original_cause(
    any_engine: AnyEngine,
) -> None:
    a, b, c = (any_engine.new_var(n) for n in "abc")
    any_engine.push(fail_plain, mutate=[a], name="root")
    middle = any_engine.push(lambda: 1, read=[a], mutate=[b], name="middle")
    last = any_engine.push(lambda: 2, read=[b], mutate=[c], name="last")
    for op in (middle, last):
        error = await _error_of(op)
        assert isinstance(error, DependencyFailedError)
        assert isinstance(error.__cause__, Boom)
        assert "'root'" in str(error)
    with pytest.raises(DependencyFailedError) as info:
        await any_engine.wait_var(c)
    assert isinstance(info.value.__cause__, Boom)


async def test_ops_before_the_failure_and_on_other_vars_are_unaffected(
    any_engine: AnyEngine,
) -> None:
    a, b = any_engine.new_var("a"), any_engine.new_var("b")
    before = any_engine.push(lambda: "before", read=[a])
    any_engine.push(fail_plain, mutate=[a])
    other = any_engine.push(lambda: "other", mutate=[b])
    assert (await before, await other) == ("before", "other")
    await any_engine.wait_var(b)


async def test_a_failed_reader_does_not_poison_the_var_it_reads(any_engine: AnyEngine) -> None:
    a, b = any_engine.new_var("a"), any_engine.new_var("b")
    any_engine.push(fail_plain, read=[a], mutate=[b])
    after = any_engine.push(lambda: "fine", read=[a], mutate=[a])
    assert await after == "fine"
    await any_engine.wait_var(a)
    with pytest.raises(DependencyFailedError):
        await any_engine.wait_var(b)


async def test_wait_all_raises_the_first_failure_pushed_then_forgets_it(
    any_engine: AnyEngine,
) -> None:
    a, b = any_engine.new_var("a"), any_engine.new_var("b")
    any_engine.push(fail_coro, mutate=[a])
    any_engine.push(fail_plain, mutate=[b])
    with pytest.raises(Boom, match="coro"):
        await any_engine.wait_all()
    await any_engine.wait_all()
    any_engine.push(fail_plain)
    with pytest.raises(Boom, match="plain"):
        await any_engine.wait_all()


async def test_a_failure_seen_through_its_handle_is_not_kept_or_raised_again(
    any_engine: AnyEngine,
) -> None:
    """A loop that handles each op's error and never calls wait_all kept every failure,
    with its traceback and what that holds (200 MiB after 200 steps of a probe)."""

    class Payload:
        data = bytearray(1 << 20)

    async def fail_holding(payload: Payload) -> None:  # on the loop: no pool thread
        raise Boom("held")  # that may still hold its work item when the test looks

    payload = Payload()
    ref = weakref.ref(payload)
    op = any_engine.push(functools.partial(fail_holding, payload))
    with pytest.raises(Boom):
        await op
    del op, payload
    gc.collect()
    assert ref() is None  # nothing in the engine holds the failed op's frames
    v = any_engine.new_var("v")
    any_engine.push(fail_plain, mutate=[v])
    with pytest.raises(DependencyFailedError):
        await any_engine.wait_var(v)  # reports the poison, not the op's failure
    with pytest.raises(Boom):  # a failure nobody looked at is still raised by wait_all
        await any_engine.wait_all()


async def test_wait_all_orders_failures_by_push_not_by_time(engine: Engine) -> None:
    a, b = engine.new_var("a"), engine.new_var("b")
    gate = asyncio.Event()

    async def fail_late() -> None:
        await until(gate)
        raise Boom("first pushed")

    async def fail_early() -> None:
        gate.set()  # the second op fails first in time
        raise Boom("second pushed")

    engine.push(fail_late, mutate=[a])
    engine.push(fail_early, mutate=[b])
    with pytest.raises(Boom, match="first pushed"):
        await engine.wait_all()
    await engine.wait_all()  # each failure is reported once
    with pytest.raises(DependencyFailedError):
        await engine.wait_var(b)  # the poison stays until clear_error


async def test_clear_error_lets_later_ops_run_while_earlier_ones_still_fail(
    any_engine: AnyEngine,
) -> None:
    a = any_engine.new_var("a")
    any_engine.push(fail_plain, mutate=[a])
    early = any_engine.push(lambda: "early", read=[a])
    any_engine.clear_error(a)
    late = any_engine.push(lambda: "late", read=[a])
    rewrite = any_engine.push(lambda: "rewrite", mutate=[a])
    assert isinstance(await _error_of(early), DependencyFailedError)
    assert (await late, await rewrite) == ("late", "rewrite")
    await any_engine.wait_var(a)


async def test_clear_error_before_the_failure_happens_applies_to_later_pushes(
    engine: Engine,
) -> None:
    a = engine.new_var("a")
    gate = asyncio.Event()

    async def fail_later() -> None:
        await until(gate)
        raise Boom("late")

    engine.push(fail_later, mutate=[a])
    early = engine.push(lambda: "early", read=[a])
    engine.clear_error(a)
    late = engine.push(lambda: "late", read=[a])
    assert late.status == "pending"  # still ordered after the writer
    gate.set()
    assert isinstance(await _error_of(early), DependencyFailedError)
    assert await late == "late"
    await engine.wait_var(a)


async def test_a_long_chain_of_poisoned_ops_fails_without_recursion(engine: Engine) -> None:
    a = engine.new_var("a")
    gate = asyncio.Event()

    async def fail_later() -> None:
        await until(gate)
        raise Boom("root")

    engine.push(fail_later, mutate=[a])
    ops = [engine.push(lambda: None, read=[a], mutate=[a]) for _ in range(5000)]
    gate.set()
    with pytest.raises(Boom):
        await engine.wait_all()
    assert all(isinstance(op.exception(), DependencyFailedError) for op in ops)
    assert engine.statistics()["failed"] == 5001


async def _error_of(op: Awaitable[Any]) -> BaseException | None:
    try:
        await op
    except Exception as exc:
        return exc
    return None
