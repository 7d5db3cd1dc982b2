"""kill -9 of a worker during shared-memory all_reduces, with real `dsml` processes.

Four workers (tests/scripts/loop_all_reduce.py, the harness of test_faults_process.py)
loop over 4 MiB all_reduces with `algorithm="shm"`; the test kills one with SIGKILL
while they run. Every survivor's call in flight fails with `PeerLostError` (seen over
the peers' TCP links, as without shared memory), the next call runs exactly over the
three survivors in a new epoch with a new shared-memory link, and once everyone is
gone no /dev/shm file of these processes is left.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from dsml.transport.shm_segment import SHM_DIR
from tests.test_faults_process import WORLD, Worker, cluster

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(90)
def test_kill_9_in_a_shared_memory_all_reduce_fails_every_survivor_then_they_go_on_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSML_SHM", "1")  # on whatever the environment says; workers inherit it
    with cluster(tmp_path) as run:
        run.start_registry()
        run.start_workers("--algorithm", "shm", "--mib", "4")
        run.wait_oks(3)
        victim, survivors = run.workers[0], run.workers[1:]
        epoch = victim.of("joined")[0]["epoch"]
        killed_at = time.time()
        victim.proc.kill()

        def lost_then_ok(w: Worker) -> bool:
            lost = w.first("lost", killed_at)
            return lost is not None and any(e["i"] > lost["i"] for e in w.of("ok"))

        run.wait(lambda: all(lost_then_ok(w) for w in survivors), "survivors lost, then ok")
        for w in survivors:
            (lost,) = w.of("lost")  # exactly once
            after = next(e for e in w.of("ok") if e["i"] > lost["i"])
            assert after["i"] == lost["i"] + 1
            assert after["size"] == WORLD - 1
            assert after["epoch"] > epoch
            print(f"worker {w.index}: PeerLostError {lost['t'] - killed_at:.3f} s after kill")
        run.finish(survivors)
        run.check_exact()
        pids = [w.proc.pid for w in run.workers]
    left = [n for n in os.listdir(SHM_DIR) if any(f".{pid}." in n for pid in pids)]
    assert not left, f"left in {SHM_DIR}: {left}"
