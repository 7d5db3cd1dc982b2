"""The threaded engine against the serial reference, over seeded random workloads.

Each workload is a random program: vars holding integers, ops that read some vars and
mutate others (computing new values from what they read and appending their id to each
mutated var's log), run as coroutine functions, plain functions, or plain functions that
return a coroutine; some fail, some vars get `clear_error` between pushes, and in gated
workloads every op is pushed before anything runs and some are cancelled. Both engines
must agree on final values, per-var mutation order, each op's outcome, `wait_var` and
`wait_all`; the threaded engine must also never let a writer overlap another user of its
var (checked by counting who is inside each var).

Set DSML_ENGINE_SEED to replay other workloads; the seed is printed (pytest -s shows it).
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dsml.engine import Engine, SerialEngine
from dsml.errors import DependencyFailedError
from tests.engine.helpers import AnyEngine

BASE_SEED = int(os.environ.get("DSML_ENGINE_SEED", "20250607"))
WORKLOADS = 240
KINDS = ("coro", "plain", "plain-returns-coro")


class OpFailed(Exception):
    """Raised by the ops a workload marks as failing."""


@dataclass(frozen=True)
class OpSpec:
    index: int
    reads: tuple[int, ...]  # may repeat, may overlap `mutates`
    mutates: tuple[int, ...]
    kind: str
    fails: bool
    clear_before: tuple[int, ...]  # vars to clear_error just before pushing this op
    cancel: bool  # only in gated workloads, where every op is still pending


@dataclass(frozen=True)
class Program:
    seed: int
    n_vars: int
    gated: bool
    ops: tuple[OpSpec, ...]


def make_program(seed: int) -> Program:
    rng = random.Random(seed)
    n_vars = rng.randint(1, 6)
    gated = rng.random() < 0.4
    ops = []
    for index in range(rng.randint(1, 24)):
        reads = [rng.randrange(n_vars) for _ in range(rng.randint(0, 3))]
        mutates = [rng.randrange(n_vars) for _ in range(rng.randint(0, 2))]
        clears = tuple(rng.randrange(n_vars) for _ in range(rng.random() < 0.07))
        cancel = gated and bool(reads or mutates) and rng.random() < 0.1
        spec = OpSpec(
            index, tuple(reads), tuple(mutates), rng.choice(KINDS), rng.random() < 0.1,
            clears, cancel,
        )  # fmt: skip
        ops.append(spec)
    return Program(seed, n_vars, gated, tuple(ops))


@dataclass
class World:
    """The data the ops work on, plus a check that users of a var never collide."""

    values: list[int]
    logs: list[list[int]]
    readers: list[int]
    writers: list[int]
    collisions: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def new(cls, n_vars: int) -> World:
        zeros = [0] * n_vars
        return cls([v + 1 for v in range(n_vars)], [[] for _ in zeros], zeros[:], zeros[:])

    def enter(self, spec: OpSpec) -> None:
        reads, mutates = _effective(spec)
        with self.lock:
            for v in reads:
                if self.writers[v]:
                    self.collisions.append(f"op {spec.index} read v{v} during a write")
                self.readers[v] += 1
            for v in mutates:
                if self.writers[v] or self.readers[v]:
                    self.collisions.append(f"op {spec.index} wrote v{v} while in use")
                self.writers[v] += 1

    def leave(self, spec: OpSpec) -> None:
        reads, mutates = _effective(spec)
        with self.lock:
            for v in reads:
                self.readers[v] -= 1
            for v in mutates:
                self.writers[v] -= 1

    def compute(self, spec: OpSpec) -> int:
        return sum((k + 2) * self.values[v] for k, v in enumerate(spec.reads)) + spec.index

    def write(self, spec: OpSpec, total: int) -> None:
        for v in _effective(spec)[1]:
            self.values[v] = (self.values[v] * 31 + total) % 1_000_003
            self.logs[v].append(spec.index)


def _effective(spec: OpSpec) -> tuple[list[int], list[int]]:
    mutates = list(dict.fromkeys(spec.mutates))
    return [v for v in dict.fromkeys(spec.reads) if v not in mutates], mutates


def make_fn(world: World, spec: OpSpec) -> Callable[[], Any]:
    """The op's function, of the spec's kind; it yields inside so collisions could show."""

    def finish(total: int) -> int:
        world.leave(spec)
        if spec.fails:
            raise OpFailed(f"op {spec.index} failed")
        world.write(spec, total)
        return total

    async def as_coro() -> int:
        world.enter(spec)
        await asyncio.sleep(0)
        total = world.compute(spec)
        await asyncio.sleep(0)
        return finish(total)

    def as_plain() -> int:
        world.enter(spec)
        time.sleep(0)  # let other threads run
        return finish(world.compute(spec))

    def as_plain_returning_coro() -> Any:
        world.enter(spec)
        total = world.compute(spec)

        async def rest() -> int:
            await asyncio.sleep(0)
            return finish(total)

        return rest()

    return {"coro": as_coro, "plain": as_plain, "plain-returns-coro": as_plain_returning_coro}[
        spec.kind
    ]


async def run_program(engine: AnyEngine, program: Program) -> tuple[Any, ...]:
    """Run the program; return everything the two engines must agree on."""
    world = World.new(program.n_vars)
    vars_ = [engine.new_var(f"v{i}") for i in range(program.n_vars)]
    gate = asyncio.Event()
    if program.gated:
        engine.push(gate.wait, mutate=vars_, name="gate")
    handles = []
    for spec in program.ops:
        for v in spec.clear_before:
            engine.clear_error(vars_[v])
        reads, mutates = [vars_[v] for v in spec.reads], [vars_[v] for v in spec.mutates]
        handles.append(engine.push(make_fn(world, spec), read=reads, mutate=mutates))
        if spec.cancel:
            assert handles[-1].cancel()
    gate.set()
    outcomes = [await _outcome(h) for h in handles]
    var_errors = [await _outcome(engine.wait_var(v)) for v in vars_]
    first_failure = await _outcome(engine.wait_all())
    await engine.aclose()
    assert world.collisions == [], world.collisions
    stats = engine.statistics()
    return world.values, world.logs, outcomes, var_errors, first_failure, stats


async def _outcome(awaitable: Any) -> tuple[str, str]:
    try:
        return "ok", repr(await awaitable)
    except DependencyFailedError as exc:
        return "dependency", repr(exc.__cause__)
    except OpFailed as exc:
        return "failed", repr(exc)
    except asyncio.CancelledError:
        return "cancelled", ""


async def test_the_threaded_engine_matches_the_serial_reference_on_random_workloads() -> None:
    print(f"engine differential: DSML_ENGINE_SEED={BASE_SEED}, {WORKLOADS} workloads")
    kinds_seen: set[str] = set()
    for offset in range(WORKLOADS):
        program = make_program(BASE_SEED + offset)
        kinds_seen.update(spec.kind for spec in program.ops)
        expected = await asyncio.wait_for(run_program(SerialEngine(), program), 10)
        actual = await asyncio.wait_for(run_program(Engine(max_workers=3), program), 10)
        assert actual == expected, f"workload seed {program.seed} differs: {program}"
    assert kinds_seen == set(KINDS)


def test_the_random_workloads_exercise_failures_clears_and_cancellations() -> None:
    programs = [make_program(BASE_SEED + offset) for offset in range(WORKLOADS)]
    specs = [spec for program in programs for spec in program.ops]
    assert sum(spec.fails for spec in specs) > 100
    assert sum(bool(spec.clear_before) for spec in specs) > 50
    assert sum(spec.cancel for spec in specs) > 20
    assert sum(program.gated for program in programs) > 50
