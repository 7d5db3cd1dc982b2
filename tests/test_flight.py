"""The flight recorder: 4-rank jobs where rank 2 hangs, and `dsml flight`'s verdict."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dsml.flight import read_records, verdict
from dsml.testing import open_local_cluster

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "flight_hang.py"


def run_job(scenario: str, flight_dir: Path) -> str:
    """`dsml run -n 4 flight_hang.py` with SCENARIO; its output, once it has exited 0."""
    env = {**os.environ, "DSML_FLIGHT_DIR": str(flight_dir), "SCENARIO": scenario}
    env["CALL_TIMEOUT"] = "2"
    env.pop("DSML_REGISTRY", None)
    proc = subprocess.run(
        [sys.executable, "-m", "dsml", "run", "-n", "4", str(SCRIPT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def dsml_flight(flight_dir: Path, *options: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "dsml", "flight", str(flight_dir), *options],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def check_common(flight_dir: Path) -> tuple[dict[int, dict[str, Any]], str, dict[str, Any]]:
    """Every rank wrote one record; the waiters timed out in #3; the verdict names rank 2."""
    records = read_records(flight_dir)
    assert sorted(records) == [0, 1, 2, 3]
    for rank in (0, 1, 3):
        last = records[rank]["calls"][-1]
        assert (last["kind"], last["cid"]) == ("all_reduce", 3)
        assert last["outcome"] in ("CollectiveTimeoutError", "CollectiveAbortedError")
        assert records[rank]["identity"]["world_size"] == 4
    assert records[2]["reason"] == "signal SIGUSR1"
    assert [c["cid"] for c in records[2]["calls"]] == [1, 2]
    text = dsml_flight(flight_dir)
    print(text)
    found = json.loads(dsml_flight(flight_dir, "--json"))
    assert found["suspects"] == [2]
    assert found["cid"] == 3
    assert found["kind"] == "all_reduce"
    assert found["waiters"] == [0, 1, 3]
    return records, text.splitlines()[0], found


def probe_of_a_waiter(records: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The probe of a waiter whose own deadline passed in #3. Not rank 0's necessarily: the
    waiters entered #3 at different times, and the first to time out aborts the call at
    the others (a loaded machine delays whom it likes), which then ask nobody."""
    timed_out = [records[r]["calls"][-1] for r in (0, 1, 3)]
    timed_out = [c for c in timed_out if c["outcome"] == "CollectiveTimeoutError"]
    assert timed_out, [records[r]["calls"][-1] for r in (0, 1, 3)]
    return timed_out[0]["waiting_for"]


@pytest.mark.timeout(60)
def test_flight_names_the_rank_that_skipped_a_collective(tmp_path: Path) -> None:
    run_job("skip", tmp_path)
    records, line, _ = check_common(tmp_path)
    assert line.startswith("rank 2 is behind: its last collective is #2 (all_reduce"), line
    assert "ranks 0, 1, 3 waited in #3 all_reduce for it" in line
    probe = probe_of_a_waiter(records)
    assert probe["missing"] == [2]
    assert probe["peers"]["2"]["last_started"] == 2
    assert records[2]["main_thread"]["loop"] == "idle"


@pytest.mark.timeout(60)
def test_flight_names_the_rank_whose_event_loop_is_blocked(tmp_path: Path) -> None:
    run_job("busy", tmp_path)
    records, line, found = check_common(tmp_path)
    assert line.startswith("rank 2 did not answer (its loop was busy in flight_hang.py:"), line
    assert "in compute: time.sleep(0.05)" in line
    assert "#3 all_reduce" in line
    assert probe_of_a_waiter(records)["peers"]["2"]["last_started"] is None
    assert found["ranks"]["2"]["main_thread"]["loop"] == "busy"


@pytest.mark.timeout(60)
def test_flight_names_the_rank_waiting_in_recv_while_the_others_wait_in_a_collective(
    tmp_path: Path,
) -> None:
    run_job("recv", tmp_path)
    records, line, _ = check_common(tmp_path)
    assert line.startswith("rank 2 waits in recv from rank 0 (tag 0, for "), line
    assert "while ranks 0, 1, 3 wait in collective #3 all_reduce" in line
    assert records[2]["receives"][0]["peer"] == 0


@pytest.mark.timeout(30)
def test_dump_flight_record_writes_the_recent_calls_and_identity(tmp_path: Path) -> None:
    async def main() -> None:
        async with open_local_cluster(2) as comms:
            x = [np.ones(8) for _ in comms]
            await asyncio.gather(*(c.all_reduce(a) for c, a in zip(comms, x, strict=True)))
            paths = [c.dump_flight_record(tmp_path) for c in comms]
            assert sorted(p.name.split("-")[0] for p in paths) == ["rank0", "rank1"]
            written = comms[0].dump_flight_record(tmp_path / "mine.json")
            assert json.loads(written.read_text())["reason"] == "requested"

    asyncio.run(main())
    records = read_records(tmp_path)
    assert sorted(records) == [0, 1]
    call = records[1]["calls"][-1]
    assert (call["kind"], call["cid"], call["outcome"], call["bytes"]) == (
        "all_reduce",
        1,
        "ok",
        64,
    )
    assert records[1]["identity"]["pid"] == os.getpid()
    assert verdict(records).lines[0].startswith("no rank waits in a collective")
