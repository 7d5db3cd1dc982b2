"""kill -9 of a parameter server's process mid-run (dsml.ps faults, real processes).

A `dsml registry` process and four ranks of tests/scripts/ps_server_kill.py: workers 0-2
push and pull in a loop, rank 3 serves. Once every worker has taken some steps the test
SIGKILLs the server. What holds today (servers are not replicated): every worker's loop
fails once, with `ServerLostError` naming server 0, a later call fails at once with the
same type, and every worker exits cleanly, nothing left hanging.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "ps_server_kill.py"
HEARTBEATS = ("--heartbeat-interval", "0.2", "--heartbeat-timeout", "2")
WORKERS, STEPS_BEFORE_KILL = 3, 20

pytestmark = pytest.mark.multiprocess


class Rank:
    """One rank's process; a thread parses its JSON lines and wakes the test."""

    def __init__(self, proc: subprocess.Popen[str], cond: threading.Condition) -> None:
        self.proc, self.cond = proc, cond
        self.events: list[dict[str, Any]] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            event = json.loads(line) if line.startswith("{") else {"event": "text", "line": line}
            event["t"] = time.monotonic()
            with self.cond:
                self.events.append(event)
                self.cond.notify_all()

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in list(self.events) if e["event"] == kind]

    def steps(self) -> int:
        return max((e["step"] for e in self.of("step")), default=0)


def start_registry() -> tuple[subprocess.Popen[str], str]:
    registry = subprocess.Popen(
        [sys.executable, "-m", "dsml", "registry", "--address", "tcp://127.0.0.1:0", *HEARTBEATS],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
    )
    assert registry.stdout is not None
    return registry, registry.stdout.readline().split()[4]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("consistency", ["async", "bsp"])
def test_kill_9_of_the_server_fails_each_worker_once_with_server_lost(consistency, tmp_path):
    registry, address = start_registry()
    cond = threading.Condition()
    ranks: list[Rank] = []
    try:
        for rank in range(WORKERS + 1):
            env = {**os.environ, "DSML_REGISTRY": address, "DSML_WORLD_SIZE": str(WORKERS + 1)}
            env.update(DSML_RANK=str(rank), OMP_NUM_THREADS="1")
            proc = subprocess.Popen(
                [sys.executable, str(SCRIPT), "--consistency", consistency],
                stdout=subprocess.PIPE,
                stderr=(tmp_path / f"rank{rank}.err").open("w"),
                text=True,
                cwd=ROOT,
                env=env,
            )
            ranks.append(Rank(proc, cond))
        workers, server = ranks[:WORKERS], ranks[WORKERS]
        began = time.monotonic()
        with cond:  # every worker is training: then the server dies
            assert cond.wait_for(
                lambda: all(w.steps() >= STEPS_BEFORE_KILL for w in workers), timeout=60
            ), [w.events[-3:] for w in ranks]
        assert server.of("serving")
        server.proc.kill()
        killed = time.monotonic()
        for w in workers:
            assert w.proc.wait(timeout=60) == 0, (tmp_path / "rank0.err").read_text()
            w.thread.join(timeout=10)
        print(
            f"{consistency}: training from {killed - began:.1f} s after start; "
            f"the workers exited {time.monotonic() - killed:.1f} s after the SIGKILL"
        )
        for index, w in enumerate(workers):
            failed = w.of("failed")
            assert len(failed) == 1, w.events[-5:]  # one typed error, not one per call
            event = failed[0]
            assert event["type"] == "ServerLostError", event
            assert event["server"] == 0
            assert event["count"] == 1
            assert event["later"] == "ServerLostError"  # later calls fail at once
            assert not w.of("finished")
            print(
                f"{consistency}: worker {index} saw ServerLostError {event['t'] - killed:.2f} s "
                f"after the SIGKILL, at step {event['step']}"
            )
    finally:
        for proc in [*(r.proc for r in ranks), registry]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
