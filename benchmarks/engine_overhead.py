"""Measure the engine's own cost per op (a benchmark, not a test: it asserts nothing).

Run: python benchmarks/engine_overhead.py [N]

Each line pushes N empty ops and waits for them all, five times, and prints the wall time
per op (best and median run);
the baselines do the same work with bare asyncio (a task per coroutine) and a bare
ThreadPoolExecutor (run_in_executor per function), so the difference is the engine's own
bookkeeping: wiring, poison checks, counters, outcome, release.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from dsml.engine import Engine


async def _empty_coro() -> None:
    return None


def _empty() -> None:
    return None


async def _timed(n: int, body: Callable[[], Awaitable[None]]) -> float:
    start = time.perf_counter()
    await body()
    return (time.perf_counter() - start) / n * 1e6


async def bare_tasks(n: int) -> float:
    async def body() -> None:
        await asyncio.gather(*(asyncio.ensure_future(_empty_coro()) for _ in range(n)))

    return await _timed(n, body)


async def bare_executor(n: int) -> float:
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(4) as pool:

        async def body() -> None:
            await asyncio.gather(*(loop.run_in_executor(pool, _empty) for _ in range(n)))

        return await _timed(n, body)


async def bare_executor_chain(n: int) -> float:
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(4) as pool:

        async def body() -> None:
            for _ in range(n):
                await loop.run_in_executor(pool, _empty)

        return await _timed(n, body)


async def engine_ops(n: int, fn: Callable[[], object], chained: bool) -> float:
    async with Engine(max_workers=4) as engine:
        var = engine.new_var("v")
        mutate = [var] if chained else []

        async def body() -> None:
            for _ in range(n):
                engine.push(fn, mutate=mutate)
            await engine.wait_all()

        return await _timed(n, body)


async def push_only(n: int) -> float:
    async with Engine() as engine:
        gate = asyncio.Event()
        var, other = engine.new_var("v"), engine.new_var("w")
        engine.push(gate.wait, mutate=[var])  # holds every later op pending
        start = time.perf_counter()
        for _ in range(n):
            engine.push(_empty_coro, read=[var], mutate=[other])
        per_op = (time.perf_counter() - start) / n * 1e6
        gate.set()
        await engine.wait_all()
        return per_op


async def main(n: int, repeats: int) -> None:
    cases: list[tuple[str, Callable[[], Awaitable[float]]]] = [
        ("push() alone (op held pending)", lambda: push_only(n)),
        ("bare asyncio: task per empty coroutine", lambda: bare_tasks(n)),
        ("engine: independent coroutine ops", lambda: engine_ops(n, _empty_coro, False)),
        ("engine: chained coroutine ops (one var)", lambda: engine_ops(n, _empty_coro, True)),
        ("bare run_in_executor per empty function", lambda: bare_executor(n)),
        ("engine: independent plain-function ops", lambda: engine_ops(n, _empty, False)),
        ("bare run_in_executor, awaited one by one", lambda: bare_executor_chain(n)),
        ("engine: chained plain-function ops (one var)", lambda: engine_ops(n, _empty, True)),
    ]
    print(f"{n} ops per run, {repeats} runs; microseconds per op (best / median)")
    for label, case in cases:
        runs = sorted([await case() for _ in range(repeats)])
        print(f"{label:48s} {runs[0]:7.1f} / {runs[len(runs) // 2]:7.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", nargs="?", type=int, default=10000, help="ops per run")
    parser.add_argument("--repeat", type=int, default=5, help="runs per case")
    args = parser.parse_args()
    asyncio.run(main(args.n, args.repeat))
