"""What `dsml run` prints when its ranks fail or are interrupted: one short report per rank
(the script's frames and the error once), the launcher's summary last; the full traceback
on request. Real launches, forked ranks and ranks started one by one."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_launch_launchers import clean_env

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
DSML = [sys.executable, "-m", "dsml"]
INTERNAL = ("shm_plane.py", "shm_link.py", "plan_reductions.py", "runner_calls.py", "mailbox.py")
MISMATCH = "CollectiveMismatchError: collective #2 does not match across ranks"


def run_mismatch(n: int, *options: str, **env: str) -> subprocess.CompletedProcess[str]:
    argv = [*DSML, "run", "-n", str(n), *options, str(SCRIPTS / "mismatch_shape.py")]
    return subprocess.run(
        argv, env=clean_env(**env), cwd=ROOT, capture_output=True, text=True, timeout=80
    )


def rank_lines(err: str, rank: int) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(f"[rank {rank}] ")]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("forkserver", ["1", "0"])
def test_a_shape_mismatch_prints_each_ranks_error_once_with_only_the_scripts_frames(forkserver):
    """It printed 265 lines at 4 ranks: the message 5 times, in dsml's frames."""
    result = run_mismatch(4, DSML_FORKSERVER=forkserver)
    err = result.stderr
    assert result.returncode == 1, err
    for rank in range(4):
        lines = rank_lines(err, rank)
        assert len(lines) <= 15, "\n".join(lines)
        assert sum(MISMATCH in line for line in lines) <= 1, "\n".join(lines)
    assert MISMATCH in err
    assert 'mismatch_shape.py", line' in err  # the user's frame
    assert "comm.all_reduce(np.ones(comm.rank + 2))" in err
    for name in INTERNAL:
        assert name not in err, err
    assert "DSML_TRACEBACK=1" in err  # how to see the rest
    # The launcher's summary comes last, after every rank's output, and names the error.
    summary = err[err.index("\ndsml run: rank ") :]
    assert "[rank " not in summary, err
    assert re.search(r"^  dsml\.errors\.CollectiveMismatchError: ", summary, re.M), summary


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["--traceback", "DSML_TRACEBACK=1"])
def test_the_full_traceback_shows_dsmls_frames_when_asked_for(how):
    if how == "--traceback":
        result = run_mismatch(2, "--traceback")
    else:
        result = run_mismatch(2, DSML_TRACEBACK="1")
    err = result.stderr
    assert result.returncode == 1, err
    assert "[rank 0] Traceback (most recent call last):" in err
    assert re.search(r'File ".*/dsml/communicator/[a-z_]+\.py", line', err), err
    assert 'mismatch_shape.py", line' in err
    assert MISMATCH in err.rsplit("\ndsml run: rank ", 1)[1]  # the summary still finds it


@pytest.mark.timeout(90)
def test_ctrl_c_prints_one_line_per_rank_and_no_cancelled_error():
    """Each rank printed about 25 lines of CancelledError and KeyboardInterrupt."""
    script = str(SCRIPTS / "interrupt_in_collective.py")
    proc = subprocess.Popen(
        [*DSML, "run", "-n", "2", script],
        env=clean_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready = 0
        while ready < 2:
            line = proc.stdout.readline()
            assert line, proc.stderr.read() if proc.stderr else ""
            ready += "ready" in line
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    for rank in range(2):
        said = [line for line in rank_lines(err, rank) if "nterrupt" in line]
        assert len(said) == 1, err
        assert "interrupt_in_collective.py:" in said[0], said  # where it was
    assert "CancelledError" not in err
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith("dsml run: interrupted by SIGINT"), err
