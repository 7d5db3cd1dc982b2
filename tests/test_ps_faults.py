"""kill -9 of a parameter server's or a worker's process mid-run (dsml.ps faults).

A `dsml registry` process and four ranks (workers 0-2, server 3), real processes.

- tests/scripts/ps_server_kill.py: the workers push and pull in a loop; once every worker
  has taken some steps the test SIGKILLs the server. What holds today (servers are not
  replicated): every worker's loop fails once, with `ServerLostError` naming server 0, a
  later call fails at once with the same type, and every worker exits cleanly.
- tests/scripts/ps_bsp_replay.py: BSP training; worker 2 waits right after its step-20
  push was taken and the test SIGKILLs it. The others finish; the server's record
  of whose gradients each step summed is replayed in this process, and the replay must
  give worker 0's final parameters bit for bit: no update lost, none applied twice.
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

import numpy as np
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


REPLAY = ROOT / "tests" / "scripts" / "ps_bsp_replay.py"


def start_ranks(
    script: Path, args: list[str], tmp_path: Path, cond: threading.Condition, servers: int = 1
):
    registry, address = start_registry()
    ranks = []
    for rank in range(WORKERS + servers):
        env = {**os.environ, "DSML_REGISTRY": address, "DSML_WORLD_SIZE": str(WORKERS + servers)}
        env.update(DSML_RANK=str(rank), OMP_NUM_THREADS="1")
        proc = subprocess.Popen(
            [sys.executable, str(script), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=(tmp_path / f"rank{rank}.err").open("w"),
            text=True,
            cwd=ROOT,
            env=env,
        )
        ranks.append(Rank(proc, cond))
    return registry, ranks


def check_history(history: list[list[int]], steps: int, stop_at: int) -> None:
    """Workers 0-2 in every step before the victim's last push, 0-1 after it; the step of
    its last push either way (a lost worker's push to a step not yet applied is dropped)."""
    assert len(history) == steps
    assert all(tuple(c) == (0, 1, 2) for c in history[:stop_at])
    assert tuple(history[stop_at]) in ((0, 1, 2), (0, 1))
    assert all(tuple(c) == (0, 1) for c in history[stop_at + 1 :])


def replay(contributors: dict[str, list[list[int]]], steps: int) -> dict[str, np.ndarray]:
    """The BSP run again in one process: each step, every key moves by SGD on the sum, in
    worker order, of the gradients of exactly the workers the server says it summed."""
    sys.path.insert(0, str(REPLAY.parent))
    import ps_bsp_replay as job

    x, y = job.data(0)
    params = job.initial(0)
    piece_of = {"w": "0", "b": "1"}  # each key is one piece: w first, as the layout cuts
    for step in range(steps):
        parts = [job.part(step, w, WORKERS, len(y)) for w in range(WORKERS)]
        grads = [job.gradient(params, x[p], y[p], 30) for p in parts]
        for key in params:
            who = contributors[piece_of[key]][step]
            total = grads[who[0]][key].copy()
            for w in who[1:]:
                total += grads[w][key]
            params[key] -= params[key].dtype.type(job.LR) * total
    return params


@pytest.mark.timeout(120)
def test_kill_9_of_a_bsp_worker_loses_no_update_and_applies_none_twice(tmp_path):
    steps, stop_at, victim = 60, 20, 2
    cond = threading.Condition()
    args = ["--steps", str(steps), "--stop-at", str(stop_at), "--victim", str(victim)]
    registry, ranks = start_ranks(REPLAY, args, tmp_path, cond)
    try:
        with cond:  # the victim's step-20 gradient is in; it waits: kill it
            assert cond.wait_for(lambda: ranks[victim].of("stopped"), timeout=60), [
                r.events[-3:] for r in ranks
            ]
        ranks[victim].proc.kill()
        for index in (0, 1, WORKERS):
            err = (tmp_path / f"rank{index}.err").read_text
            assert ranks[index].proc.wait(timeout=60) == 0, err()
            ranks[index].thread.join(timeout=10)
        (server,) = ranks[WORKERS].of("server")
        (final,) = ranks[0].of("final")
        assert server["lost"] == [victim]
        for piece, history in server["contributors"].items():
            assert server["updates"][piece] == steps  # one update per step, none twice
            check_history(history, steps, stop_at)
        expected = replay(server["contributors"], steps)
        for key, value in expected.items():  # bitwise: the same sums in the same order
            assert np.array_equal(np.array(final["params"][key]), value), key
    finally:
        for proc in [*(r.proc for r in ranks), registry]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("also_a_worker", [False, True])
def test_kill_9_of_a_replicated_bsp_server_loses_no_update_and_applies_none_twice(
    also_a_worker, tmp_path
):
    """Server 0 of 2 (replicas=1) is killed while a BSP step is in flight; with
    `also_a_worker`, worker 2 is killed at the same moment. The workers left finish; the
    backup's record of each step's sums, replayed, gives worker 0's parameters bitwise."""
    steps, stop_at, victim = 60, 20, 2 if also_a_worker else 0
    cond = threading.Condition()
    args = ["--steps", str(steps), "--stop-at", str(stop_at), "--victim", str(victim)]
    args += ["--servers", "2", "--replicas", "1"]
    registry, ranks = start_ranks(REPLAY, args, tmp_path, cond, servers=2)
    try:
        with cond:  # the victim waits after its step-20 push: the run is mid-step
            assert cond.wait_for(lambda: ranks[victim].of("stopped"), timeout=60), [
                r.events[-3:] for r in ranks
            ]
        ranks[WORKERS].proc.kill()  # server 0, the primary of w's shard
        if also_a_worker:
            ranks[victim].proc.kill()
        else:
            stdin = ranks[victim].proc.stdin
            assert stdin is not None
            stdin.write("go on\n")
            stdin.flush()
        survivors = [w for w in range(WORKERS) if not (also_a_worker and w == victim)]
        for index in (*survivors, WORKERS + 1):
            err = (tmp_path / f"rank{index}.err").read_text
            assert ranks[index].proc.wait(timeout=60) == 0, err()
            ranks[index].thread.join(timeout=10)
        (backup,) = ranks[WORKERS + 1].of("server")
        (final,) = ranks[0].of("final")
        replica = backup["replica"]
        assert replica["took_over"] is True
        assert replica["shard"] == 0
        # w's shard (piece 0) from the backup's copy, b's (piece 1) from server 1 itself
        contributors = {"0": replica["contributors"]["0"], "1": backup["contributors"]["1"]}
        for piece, history in contributors.items():  # one update per step, none twice
            if also_a_worker:
                check_history(history, steps, stop_at)
            else:
                assert history == [[0, 1, 2]] * steps, piece
        expected = replay(contributors, steps)
        for key, value in expected.items():  # bitwise the replay of those sums
            assert np.array_equal(np.array(final["params"][key]), value), key
    finally:
        for proc in [*(r.proc for r in ranks), registry]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
