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


def _run_in_small_dev_shm(fill_mib: int, ranks: int, sizes_mib: tuple[int, ...]) -> str:
    """Run `dsml run -n ranks shm_room.py sizes` in a 64 MiB /dev/shm of which fill_mib
    are taken by a file (removed after); returns the output, ending LEFT=<names left>."""
    sizes = " ".join(str(s) for s in sizes_mib)
    fill = f"dd if=/dev/zero of=/dev/shm/filler bs=1M count={fill_mib} 2>/dev/null; "
    script = (
        "set -e; mount -t tmpfs -o size=64m dsml-test /dev/shm; "
        + (fill if fill_mib else "")
        + f"{sys.executable} -m dsml run -n {ranks} tests/scripts/shm_room.py {sizes}; "
        "rm -f /dev/shm/filler; echo LEFT=$(ls -A /dev/shm | wc -l)"
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
    return out


def _oks(out: str) -> list[dict]:
    events = [
        json.loads(line[line.index("{") :]) for line in out.splitlines() if '{"event"' in line
    ]
    return [e for e in events if e["event"] == "ok"]


@pytest.mark.timeout(120)
def test_a_64_mib_dev_shm_runs_large_arrays_over_tcp_exactly_with_one_warning_per_rank():
    reason = _why_not()
    if reason is not None:
        pytest.skip(reason)
    out = _run_in_small_dev_shm(0, 4, SIZES_MIB)
    oks = _oks(out)
    assert len(oks) == 4 * len(SIZES_MIB), out
    assert all(e["exact"] for e in oks), out
    ran = {mib: {e["ran"] for e in oks if e["mib"] == mib} for mib in SIZES_MIB}
    assert ran[1] == {"shm"}, out  # fits: shared memory
    assert len(ran[48]) == 1, out  # every rank ran the same algorithm
    assert ran[48] != {"shm"}, out  # no room on any rank: TCP on all
    warnings = [line for line in out.splitlines() if WARNING in line]
    assert len(warnings) == 4, out  # once per rank, not once per call
    assert "LEFT=0" in out, out


# 2 MiB free: no rank has room for its link's control segment (2 MiB and a header);
# 3 MiB free: the first rank to make its own takes the room, the other finds none.
@pytest.mark.timeout(120)
@pytest.mark.parametrize("free_mib", [2, 3])
def test_a_nearly_full_dev_shm_runs_a_64_mib_all_reduce_over_tcp_on_every_rank(free_mib):
    reason = _why_not()
    if reason is not None:
        pytest.skip(reason)
    out = _run_in_small_dev_shm(64 - free_mib, 2, (1, 64))
    oks = _oks(out)
    assert len(oks) == 2 * 2, out  # no CollectiveAbortedError: every call ran
    assert all(e["exact"] for e in oks), out
    assert {e["ran"] for e in oks} == {"ring"}, out  # TCP on every rank, both sizes
    warnings = [line for line in out.splitlines() if "no room in shared memory for" in line]
    assert len(warnings) == 2, out  # one per rank
    assert "LEFT=0" in out, out  # markers and segments removed
