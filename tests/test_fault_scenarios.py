"""Seeded random fault scenarios: every call ends (a result or a DsmlError), never hangs.

Each scenario starts a small group in this process, injects one kind of fault into one
rank's outgoing messages (drop, delay, crash after k messages, partition from one peer)
and runs a few rounds of all_reduce on every rank. The checks: no call outlives a bound
far above its timeout; a call that returns has the exact result; after a crash, the
survivors' next successful call is exact over the survivors. The seed of each scenario is
in its test id; `python -m pytest tests/test_fault_scenarios.py -k 17` replays one.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from dsml import CommConfig, DsmlError, PeerLostError
from dsml.testing import Faults, inject, open_local_cluster

SCENARIOS = 50
BASE_SEED = 20261122
CONFIG = CommConfig(timeout=0.4, probe_timeout=0.15, join_timeout=10, view_timeout=5)
HANG_S = 8.0  # a call still running after this long counts as a hang
ROUNDS = 3


def plan(seed: int) -> tuple[int, int, str, Faults]:
    rng = random.Random(seed)
    world = rng.choice([2, 3, 4])
    victim = rng.randrange(world)
    kind = rng.choice(["drop", "delay", "crash", "partition"])
    faults = Faults(seed=seed)
    if kind == "drop":
        faults.drop = rng.choice([0.05, 0.3, 1.0])
    elif kind == "delay":
        faults.delay, faults.max_delay_s = 0.5, rng.choice([0.01, 0.1])
    elif kind == "crash":
        faults.crash_after = rng.randrange(0, 12)
    return world, victim, kind, faults


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scenario", range(SCENARIOS))
async def test_a_random_fault_never_hangs_and_never_gives_a_wrong_result(scenario):
    seed = BASE_SEED + scenario
    world, victim, kind, faults = plan(seed)
    print(f"seed={seed} world={world} victim={victim} kind={kind} {faults}")
    async with open_local_cluster(world, config=CONFIG) as cluster:
        if kind == "partition":
            other = (victim + 1) % world
            faults.partition = {cluster[other].member_id}
        inject(cluster[victim], faults)
        alive = set(range(world))
        for round_ in range(ROUNDS):
            ranks = sorted(alive)
            size = len(ranks)
            xs = {r: np.full(1000 + 37 * round_, float(r + 1)) for r in ranks}
            outcomes = await asyncio.gather(
                *(_bounded(cluster[r].all_reduce(xs[r])) for r in ranks), return_exceptions=True
            )
            for r, outcome in zip(ranks, outcomes, strict=True):
                if r == victim and faults.crashed:
                    continue  # a dead process: what its calls did does not matter
                assert not isinstance(outcome, TimeoutError) or isinstance(outcome, DsmlError), (
                    f"seed {seed}: rank {r} hung in round {round_}"
                )
                if isinstance(outcome, np.ndarray):
                    members = [q for q in ranks if cluster[q].world_size == size] or ranks
                    assert (outcome == sum(q + 1 for q in members)).all(), (seed, r, round_)
                else:
                    assert isinstance(outcome, DsmlError), (seed, r, outcome)
            if faults.crashed:
                alive.discard(victim)
        if faults.crashed:  # the survivors go on, exactly, in the new view
            survivors = sorted(alive)
            for _ in range(3):
                results = await asyncio.gather(
                    *(_bounded(cluster[r].all_reduce(np.ones(10))) for r in survivors),
                    return_exceptions=True,
                )
                if all(isinstance(x, np.ndarray) for x in results):
                    break
                assert all(isinstance(x, DsmlError) for x in results), (seed, results)
            assert all(isinstance(x, np.ndarray) for x in results), (seed, results)
            assert all((x == len(survivors)).all() for x in results), seed


async def _bounded(handle):
    try:
        async with asyncio.timeout(HANG_S):
            return await handle
    except TimeoutError as exc:
        if isinstance(exc, DsmlError):
            raise
        raise AssertionError("hang") from None


def test_the_scenarios_cover_every_kind_of_fault():
    kinds = {plan(BASE_SEED + s)[2] for s in range(SCENARIOS)}
    assert kinds == {"drop", "delay", "crash", "partition"}
    assert issubclass(PeerLostError, DsmlError)
