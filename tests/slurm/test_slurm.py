"""Real Slurm: `srun -N2 -n4` on a throw-away cluster of two namespaced nodes.

The tasks get exactly what Slurm gives them: no DSML_* variable, no DSML_BIND, nothing
but SLURM_* (and PATH/PYTHONPATH). `dsml.init()` must find the group from those alone:
the registry in task 0 on the first node of the step, the others reaching it by the
node's name.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.harness.netns import PYTHON, ROOT, child_env
from tests.harness.slurm import SlurmCluster

pytestmark = pytest.mark.multiprocess

SHOW = (
    "import json, os, socket; print(json.dumps({'host': socket.gethostname(), "
    "**{k: v for k, v in os.environ.items() if k.startswith('SLURM_')}}))"
)


def srun(cluster: SlurmCluster, args: list[str], out_dir: Path, timeout: float = 45.0) -> list:
    """Run `srun -N2 -n4 ARGS` to the end; return every task's JSON lines, task by task.

    Each task writes its own file (`--output=.../task-%t.out`): srun's merged stdout may
    interleave long lines of different tasks.
    """
    proc = cluster.srun(
        ["-N2", "-n4", "--kill-on-bad-exit=1", f"--output={out_dir}/task-%t.out", *args],
        child_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"srun did not end in {timeout} s:\n{out}\n{cluster.logs()}") from None
    outputs = [(out_dir / f"task-{t}.out").read_text() for t in range(4)]
    report = f"srun exited {proc.returncode}:\n{out}\n" + "\n".join(outputs)
    assert proc.returncode == 0, f"{report}\n{cluster.logs()}"
    return [
        [json.loads(line) for line in text.splitlines() if line.startswith("{")] for text in outputs
    ]


def test_srun_places_two_tasks_on_each_of_two_namespaced_nodes(
    slurm_cluster: SlurmCluster, tmp_path: Path
):
    tasks = [lines[0] for lines in srun(slurm_cluster, [PYTHON, "-c", SHOW], tmp_path)]
    assert [t["SLURM_PROCID"] for t in tasks] == ["0", "1", "2", "3"]
    assert [t["host"] for t in tasks] == ["n1", "n1", "n2", "n2"]
    assert {t["SLURM_STEP_NODELIST"] for t in tasks} == {"n[1-2]"}
    assert {t["SLURM_NTASKS"] for t in tasks} == {"4"}
    assert not any(k.startswith("DSML_") for t in tasks for k in t)


def test_srun_tasks_form_one_group_from_slurm_variables_alone(
    slurm_cluster: SlurmCluster, tmp_path: Path
):
    worker = [PYTHON, "tests/multihost/worker.py", "--calls", "2"]
    tasks = srun(slurm_cluster, worker, tmp_path)
    for task, events in enumerate(tasks):
        joined = [e for e in events if e["event"] == "joined"]
        assert len(joined) == 1, events
        assert joined[0]["env"]["SLURM_PROCID"] == str(task)
        assert joined[0]["rank"] == task  # comm.rank == SLURM_PROCID
        assert joined[0]["size"] == 4
        assert joined[0]["host"] == ("n1" if task < 2 else "n2")
        assert [e["exact"] for e in events if e["event"] == "ok"] == [True, True], events
