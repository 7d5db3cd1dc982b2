"""Calls never awaited, and calls from two threads at once (issue 33, item 4).

A handle dropped without being awaited or cancelled warns (`RuntimeWarning`) naming the
call and the line that made it, as asyncio does for a coroutine; closing names the calls
whose results nobody took; a call from a thread while another thread's calls are in
flight raises `ConcurrentCallsError`. Real sockets over loopback (`open_local_cluster`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import warnings

import numpy as np
import pytest

import dsml
from dsml.testing import open_local_cluster

pytestmark = pytest.mark.timeout(60)


def _line_of(marker: str) -> int:
    with open(__file__) as source:
        return next(i for i, line in enumerate(source, 1) if marker in line)


async def test_a_handle_dropped_without_await_warns_naming_the_call_and_its_line():
    async with open_local_cluster(2) as cluster:

        async def forget(comm):
            x = np.ones(8) * (comm.rank + 1)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                comm.all_reduce(x)  # FORGOTTEN-AWAIT
                gc.collect()
            await comm.barrier()  # in program order after the all_reduce: it has ended
            return [str(w.message) for w in seen if w.category is RuntimeWarning], x

        results = await cluster.run(forget)
    where = f"test_unawaited.py:{_line_of('# FORGOTTEN' + '-AWAIT')}"
    for messages, x in results:
        assert len(messages) == 1, messages
        assert "all_reduce #1" in messages[0], messages
        assert "never awaited" in messages[0], messages
        assert where in messages[0], messages
        assert (x == 3).all()  # the call itself ran


async def test_awaited_cancelled_or_inspected_handles_do_not_warn():
    async with open_local_cluster(2) as cluster:

        async def use(comm):
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)
                await comm.all_reduce(np.ones(4))
                h = comm.all_reduce(np.ones(4))
                await asyncio.wait([asyncio.ensure_future(comm.barrier())])
                h.result()  # done: the barrier came after it
                await asyncio.gather(comm.broadcast(np.ones(4)), comm.all_gather(np.ones(2)))
                await comm.engine.push(lambda: comm.all_reduce(np.ones(4)), mutate=[comm.var])
                tagged = dsml.Tagged(np.ones(4), comm.engine.new_var("g"))
                await comm.push_all_reduce(tagged)
                del h
                gc.collect()
            return True

        assert await cluster.run(use) == [True, True]


async def test_closing_names_the_calls_whose_results_were_never_awaited(caplog):
    kept = []
    cluster = await open_local_cluster(2)
    try:

        async def keep(comm):
            h = comm.all_reduce(np.ones(4))  # KEPT-UNAWAITED
            kept.append(h)
            await comm.barrier()
            return h.cid

        cids = await cluster.run(keep)
    finally:
        with caplog.at_level(logging.WARNING, logger="dsml.communicator"):
            await cluster.aclose()
    for h in kept:
        h.claim()  # named at close; not warned of again when dropped
    assert cids == [1, 1]
    lines = [r.getMessage() for r in caplog.records if "never awaited" in r.getMessage()]
    assert len(lines) == 2, caplog.text  # once per rank
    where = f"test_unawaited.py:{_line_of('# KEPT' + '-UNAWAITED')}"
    assert all("all_reduce #1" in line and where in line for line in lines), lines


async def _in_new_thread(fn):
    """fn() in a thread of its own (a pool might reuse one thread for two calls)."""
    outcome = []

    def run():
        try:
            outcome.append(fn())
        except BaseException as exc:  # handed back to the test
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    await asyncio.to_thread(thread.join)
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


async def test_a_call_from_a_second_thread_while_the_first_threads_call_is_in_flight_raises():
    """Rank 0's thread A starts an all_reduce that waits for rank 1; its thread B then
    calls and is refused. Once A's call has ended, a third thread may call (a handover)."""
    async with open_local_cluster(2) as cluster:
        refused = asyncio.Event()

        async def on_rank(comm):
            if comm.rank == 1:
                await refused.wait()  # rank 0's first call stays in flight until now
            x = np.ones(4) * (comm.rank + 1)
            first = await _in_new_thread(lambda: comm.all_reduce(x))  # thread A
            error = None
            if comm.rank == 0:
                try:
                    await _in_new_thread(lambda: comm.all_reduce(np.ones(4)))  # thread B
                except dsml.ConcurrentCallsError as exc:
                    error = exc
                refused.set()
            await first
            second = np.ones(4)
            await (await _in_new_thread(lambda: comm.all_reduce(second)))  # thread C
            return error, x, second

        (error, x0, s0), (none, x1, s1) = await cluster.run(on_rank)
    assert isinstance(error, dsml.ConcurrentCallsError)
    assert isinstance(error, dsml.ConfigError)
    assert "one order on every rank" in str(error)
    assert none is None
    for x, s in ((x0, s0), (x1, s1)):
        assert (x == 3).all()  # nothing paired wrongly
        assert (s == 2).all()
