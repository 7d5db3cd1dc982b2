"""torch's own `DistributedTest._DistTestBase` against the "dsml" backend (a CI subset).

tests/scripts/torch_dist_test_base.py drives torch's test class as pytorch's
test_distributed_spawn.py does, with gloo's test selection and every group made with
"dsml". Here: its `ci` subset (collectives, groups, point to point, DDP with a comm hook,
and every entry point of issue 35) at world 2, ranks forked (spawned ones re-import
torch's test module, seconds per test). The whole selection is a documented command
(docs/torch.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install dsml[torch])")
pytest.importorskip("expecttest", reason="torch's test utilities need expecttest (dsml[test])")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "scripts" / "torch_dist_test_base.py"


def run_suite(backend: str, world: int, subset: str) -> dict[str, object]:
    """The driver's counts (its last line) for one backend and world size."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSML_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    args = ["--backend", backend, "--world", str(world), "--subset", subset, "--start", "fork"]
    result = subprocess.run(
        [sys.executable, str(DRIVER), *args],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=ROOT,
        env=env,
    )
    lines = result.stdout.strip().splitlines()
    assert lines, result.stderr[-3000:]
    assert lines[-1].startswith("{"), result.stdout[-3000:] + result.stderr[-3000:]
    counts: dict[str, object] = json.loads(lines[-1])
    counts["log"] = result.stdout[-6000:]
    return counts


def test_torchs_own_distributed_tests_pass_on_dsml():
    counts = run_suite("dsml", 2, "ci")
    print({k: v for k, v in counts.items() if k != "log"})
    assert counts["failed"] == 0, counts["log"]
    assert isinstance(counts["passed"], int)
    assert counts["passed"] >= 18, counts
