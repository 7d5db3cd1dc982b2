"""Shared memory on by default: it follows the group's failures and injected faults as TCP does.

In-process clusters over real sockets (every rank on this host, so collectives run in
shared memory unless said otherwise), and one subprocess for what happens at exit:

- the default is on, and `DSML_SHM=0` turns it off;
- a rank that crashes in the middle of a shared-memory call marks the call given up; the
  survivors still fail with `PeerLostError` (the group's verdict), also with the registry
  down, and their next call runs exactly over the survivors, in shared memory again;
- a partition injected with `dsml.testing` reaches shared memory: the cut rank's call
  stalls (it times out) instead of silently succeeding, and runs again once healed;
- a program that exits with a `dsml.blocking` loop thread still running has that loop
  stopped while the interpreter is whole (its tasks end cancelled, cleanly).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dsml import (
    CollectiveTimeoutError,
    CommConfig,
    MembershipChangedError,
    PeerLostError,
    RegistryConfig,
)
from dsml.testing import Faults, crash, inject, open_local_cluster
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parent.parent
HB = RegistryConfig(heartbeat_interval=0.05, heartbeat_timeout=0.5)
CONFIG = CommConfig(timeout=8, view_timeout=8, join_timeout=10, registry_timeout=2)
#: nobody is declared silent during a short partition
PATIENT = RegistryConfig(heartbeat_interval=0.5, heartbeat_timeout=10.0)


@pytest.fixture(autouse=True)
def shm_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the environment says, these tests see the library's default."""
    monkeypatch.delenv("DSML_SHM", raising=False)


def test_shared_memory_is_on_by_default() -> None:
    assert CommConfig().shm is True


async def test_dsml_shm_0_turns_the_default_off_and_nothing_else_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with open_local_cluster(2) as cluster:
        await cluster.run(lambda c: c.all_reduce(np.ones(8)))
        assert all(c._session.shm.plane.calls == 1 for c in cluster)
    monkeypatch.setenv("DSML_SHM", "0")
    async with open_local_cluster(2) as cluster:
        await cluster.run(lambda c: c.all_reduce(np.ones(8)))
        assert all(c._session.shm.plane.calls == 0 for c in cluster)


@pytest.mark.timeout(60)
async def test_a_rank_crashing_mid_call_without_registry_fails_every_survivor_with_peer_lost():
    """Rank 2 enters a shared-memory all_reduce alone and crashes in it (its call is
    cancelled, so it marks the call given up in shared memory); then ranks 0 and 1 enter
    and see that mark. The registry is down, so the loss is the survivors' own verdict,
    about a second later: every survivor must fail with that verdict (PeerLostError), not
    with a local "rank 2 gave up" of its own."""
    async with open_local_cluster(3, config=CONFIG, registry_config=HB) as cluster:
        await cluster.run(lambda c: c.all_reduce(np.ones(4)))
        await cluster.registry.aclose()
        alone = asyncio.ensure_future(cluster[2].all_reduce(np.ones(4)))
        await eventually(lambda: cluster[2]._session.shm.plane.calls == 2, "rank 2 in the shm call")
        await asyncio.sleep(0.05)  # rank 2 waits inside the call (for the others)
        await crash(cluster[2])
        await eventually(alone.done, "the crashed rank's call ended")
        assert alone.cancelled() or alone.exception() is not None
        survivors = [cluster[r].all_reduce(np.ones(4)) for r in (0, 1)]
        for outcome in await asyncio.gather(*survivors, return_exceptions=True):
            assert isinstance(outcome, PeerLostError), repr(outcome)
        # the next call runs over the two survivors, exactly, in shared memory again
        before = [cluster[r]._session.shm.plane.calls for r in (0, 1)]
        for _ in range(3):
            results = await asyncio.gather(
                *(cluster[r].all_reduce(np.full(4, r + 1.0)) for r in (0, 1)),
                return_exceptions=True,
            )
            if all(isinstance(x, np.ndarray) for x in results):
                break
            assert all(isinstance(x, MembershipChangedError) for x in results), results
        assert all((x == 3.0).all() for x in results), results
        assert [cluster[r].world_size for r in (0, 1)] == [2, 2]
        assert all(cluster[r]._session.shm.plane.calls > before[i] for i, r in enumerate((0, 1)))


@pytest.mark.timeout(60)
async def test_a_partition_injected_on_the_data_links_stalls_the_shared_memory_path_too():
    async with open_local_cluster(2, config=CONFIG, registry_config=PATIENT) as cluster:
        await cluster.run(lambda c: c.all_reduce(np.ones(4)))
        cut = [
            inject(cluster[0], Faults(partition={cluster[1].member_id})),
            inject(cluster[1], Faults(partition={cluster[0].member_id})),
        ]
        calls = [c._session.shm.plane.calls for c in cluster]
        outcomes = await asyncio.gather(
            *(c.all_reduce(np.ones(4), timeout=0.5) for c in cluster), return_exceptions=True
        )
        # in shared memory, and stalled there as on dropped messages: no silent success
        assert [c._session.shm.plane.calls for c in cluster] == [n + 1 for n in calls]
        for outcome in outcomes:
            assert isinstance(outcome, CollectiveTimeoutError), repr(outcome)
        for f in cut:
            f.partition.clear()
        results = await cluster.run(lambda c: c.all_reduce(np.full(4, c.rank + 1.0)))
        assert all((x == 3.0).all() for x in results)


EXIT_SCRIPT = """
import asyncio, sys
from dsml.blocking import LoopThread

async def hold():
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        print("cancelled cleanly", flush=True)
        raise

loop = LoopThread()
loop.start(hold(), "hold")
loop.call(lambda: None)  # hold() has started
sys.exit(3)  # without loop.stop(): the program forgot to close
"""


@pytest.mark.timeout(60)
def test_a_loop_thread_left_running_is_stopped_at_exit_while_the_interpreter_is_whole() -> None:
    result = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT],
        capture_output=True,
        text=True,
        timeout=50,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 3, result.stderr
    assert result.stdout.strip() == "cancelled cleanly", (result.stdout, result.stderr)
