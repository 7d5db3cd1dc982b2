"""A container's small /dev/shm: a real 64 MiB tmpfs, four ranks, arrays up to 48 MiB.

The test mounts a 64 MiB tmpfs on /dev/shm in a private mount namespace of its own
(`unshare --mount`, so the machine's /dev/shm is untouched) and runs `dsml run -n 4` in
it. Small arrays go through shared memory; arrays whose segments do not fit go over TCP
on every rank, exactly, with one warning per rank; nothing is left in that /dev/shm
afterwards. Needs root (mount); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]
SIZES_MIB = (1, 8, 48)
WARNING = "no room in shared memory"


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "mounting a small /dev/shm needs root"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "true"], capture_output=True
    )
    return None if probe.returncode == 0 else "this kernel refuses a private mount namespace"


@pytest.mark.timeout(120)
def test_a_64_mib_dev_shm_runs_large_arrays_over_tcp_exactly_with_one_warning_per_rank():
    reason = _why_not()
    if reason is not None:
        pytest.skip(reason)
    sizes = " ".join(str(s) for s in SIZES_MIB)
    script = (
        "set -e; mount -t tmpfs -o size=64m dsml-test /dev/shm; "
        f"{sys.executable} -m dsml run -n 4 tests/scripts/shm_room.py {sizes}; "
        "echo LEFT=$(ls -A /dev/shm | wc -l)"
    )
    env = {**os.environ, "DSML_SHM": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    events = [
        json.loads(line[line.index("{") :]) for line in out.splitlines() if '{"event"' in line
    ]
    oks = [e for e in events if e["event"] == "ok"]
    assert len(oks) == 4 * len(SIZES_MIB), out
    assert all(e["exact"] for e in oks), out
    ran = {mib: {e["ran"] for e in oks if e["mib"] == mib} for mib in SIZES_MIB}
    assert ran[1] == {"shm"}, out  # fits: shared memory
    assert len(ran[48]) == 1, out  # every rank ran the same algorithm
    assert ran[48] != {"shm"}, out  # no room on any rank: TCP on all
    warnings = [line for line in out.splitlines() if WARNING in line]
    assert len(warnings) == 4, out  # once per rank, not once per call
    assert "LEFT=0" in out, out
