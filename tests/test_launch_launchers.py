"""`dsml.init()` with no arguments under real launchers: torchrun, mpiexec (MPICH Hydra)
and srun's variables. Each forms one group whose ranks are the launcher's ranks."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from dsml.launch import slurm_port
from tests.harness.procs import joined_output

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "scripts" / "launch_check.py")
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.multiprocess

_LAUNCHER_PREFIXES = ("DSML_", "SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_", "MPI_")
_LAUNCHER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's or dsml's variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(_LAUNCHER_PREFIXES) and k not in (*_LAUNCHER_NAMES, "MASTER_PORT")
    }
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)
    return env


def free_port(low: int = 0) -> int:
    """A TCP port nobody listens on now (from `low` upwards, or any with 0)."""
    for port in range(low, 65536) if low else [0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise AssertionError("no free port")


INSTALLED_BY = {  # what puts each launcher in the venv (the skip reason says it)
    "torchrun": "it comes with torch: pip install dsml[torch]; .ci/run installs the CPU build",
    "mpiexec": "pip install '.[test]' installs MPICH's",
}


def tool(name: str) -> str:
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed ({INSTALLED_BY.get(name, 'see README.md')})")
    return str(path)


def reports(output: str) -> list[dict[str, object]]:
    """The JSON reports in output (after a `[rank i] ` prefix, under dsml run)."""
    marker = "LAUNCH "
    return [
        json.loads(line[line.index(marker) + len(marker) :])
        for line in output.splitlines()
        if marker in line
    ]


def assert_one_group(output: str, n: int) -> None:
    """n ranks reported one group of n whose ranks are the launcher's, results exact."""
    found = reports(output)
    assert len(found) == n, output
    for report in found:
        assert report["rank"] == report["launcher_rank"], report
        assert report["world_size"] == n, report
        assert report["sum_ok"] is True, report
        assert report["ranks"] == list(range(n)), report
    assert len({r["epoch"] for r in found}) == 1
    assert sorted(r["rank"] for r in found) == list(range(n))  # type: ignore[type-var]


def run(argv: list[str], env: Mapping[str, str], timeout: float = 50) -> str:
    proc = subprocess.run(
        argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_torchrun_nproc_per_node_4_forms_one_group_with_torchruns_ranks() -> None:
    port = free_port()
    argv = [tool("torchrun"), "--nproc-per-node", "4", "--master-addr", "127.0.0.1"]
    out = run([*argv, "--master-port", str(port), SCRIPT, "RANK"], clean_env())
    assert_one_group(out, 4)


def test_torchrun_max_restarts_forms_a_new_group_after_a_rank_crashed() -> None:
    """torchrun restarts every rank after one dies; the restarted ranks form a new group
    (a new registry under a new store key, not the first attempt's) and compute exactly."""
    port = free_port()
    script = str(ROOT / "tests" / "scripts" / "torchrun_restart.py")
    argv = [tool("torchrun"), "--nproc-per-node", "2", "--max-restarts", "1"]
    argv += ["--monitor-interval", "0.2", "--master-addr", "127.0.0.1"]
    out = run([*argv, "--master-port", str(port), script], clean_env(), timeout=80)
    found = [
        json.loads(line.split("RESTART ", 1)[1]) for line in out.splitlines() if "RESTART " in line
    ]
    second = sorted((r["rank"], r["call"], r["value"]) for r in found if r["attempt"] == 1)
    assert second == [(0, 1, 3.0), (0, 2, 6.0), (1, 1, 3.0), (1, 2, 6.0)], out
    assert {(r["rank"], r["call"]) for r in found if r["attempt"] == 0} >= {(1, 1)}


def test_mpiexec_hydra_with_master_addr_forms_one_group_with_the_mpi_ranks() -> None:
    port = free_port()
    argv = [tool("mpiexec"), "-n", "4", "-genv", "MASTER_ADDR", "127.0.0.1"]
    out = run(
        [*argv, "-genv", "MASTER_PORT", str(port), sys.executable, SCRIPT, "PMI_RANK"], clean_env()
    )
    assert_one_group(out, 4)


def test_srun_variables_alone_form_one_group_at_the_port_derived_from_the_job_id() -> None:
    port = free_port(20000 + os.getpid() % 30000)
    job_id, step_id = (port - 20000) // 4, (port - 20000) % 4
    assert slurm_port(job_id, step_id) == port
    n = 4
    procs = []
    for rank in range(n):
        env = clean_env(
            SLURM_PROCID=str(rank),
            SLURM_NTASKS=str(n),
            SLURM_LOCALID=str(rank % 2),
            SLURM_NODEID=str(rank // 2),
            SLURM_STEP_NODELIST="localhost,n[02-04]",  # the first node serves the registry
            SLURM_JOB_ID=str(job_id),
            SLURM_STEP_ID=str(step_id),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, SCRIPT, "SLURM_PROCID"],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    output = joined_output(procs)
    assert_one_group(output, n)
    assert all(f":{port}" not in str(r["address"]) for r in reports(output))
