"""Training frameworks on the torch backend "dsml", on CPU, in real processes: Hugging
Face accelerate (with the recipe of docs/torch.md: the process group first) and
Lightning's Trainer (`DDPStrategy(process_group_backend="dsml")`). Each trains a small
model and must end with the parameters of the same steps taken in one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install dsml[torch])")

# torch takes seconds to import in each process, the frameworks more, on a busy machine
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
QUIET = {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def dsml_run(n: int, script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`dsml run -n n script` in `cwd` (the frameworks write their files there)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSML_")}
    return subprocess.run(
        [sys.executable, "-m", "dsml", "run", "-n", str(n), str(SCRIPTS / script)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=cwd,
        env={
            **env,
            **QUIET,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        },
    )


# One world size each (the frameworks take seconds to import in every rank): accelerate
# shards batches, Lightning samples; an even and an odd world between them.


_EXTRA = 'pip install "dsml[frameworks]", after torch'


def test_accelerate_trains_on_dsml_when_the_process_group_is_made_first(tmp_path):
    pytest.importorskip("accelerate", reason=f"accelerate is not installed ({_EXTRA})")
    result = dsml_run(2, "torch_accelerate.py", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count(" ok (") == 2, result.stdout


def test_lightning_trains_on_dsml_with_its_ddp_strategy(tmp_path):
    pytest.importorskip("pytorch_lightning", reason=f"Lightning is not installed ({_EXTRA})")
    result = dsml_run(3, "torch_lightning.py", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count(" ok (") == 3, result.stdout
