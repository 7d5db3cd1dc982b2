"""`dsml run` starts Python ranks from a fork server: they run as `python SCRIPT` would.

Real launches (`python -m dsml run`), real forked processes. What is checked: the ranks
are forked from one server (same parent, same address layout), each runs the script as
`__main__` with its own argv, sys.path, environment, working directory and random
state; exits, exceptions, signals and `-m` modules look as they do for interpreters
started one by one; and the fall-backs (DSML_FORKSERVER=0, a server with threads)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dsml.launch.forkserver import forkable
from tests.test_launch_launchers import clean_env

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the fork server is Linux's")

ROOT = Path(__file__).resolve().parent.parent
DSML = [sys.executable, "-m", "dsml"]

PROBE = """
import json, os, random, sys
import numpy as np
maps = [line.split()[0] for line in open("/proc/self/maps") if "_multiarray_umath" in line]
print("PROBE " + json.dumps({
    "name": __name__,
    "file": __file__,
    "argv": sys.argv,
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "rank": int(os.environ["DSML_RANK"]),
    "mine": os.environ.get("MY_VAR"),
    "ppid": os.getppid(),
    "sid_is_pid": os.getsid(0) == os.getpid(),
    "numpy_at": maps[0],
    "np_draw": int(np.random.randint(1 << 62)),
    "draw": random.getrandbits(62),
    "stdin": sys.stdin.read(),
    "main_is_module": sys.modules["__main__"].__dict__ is globals(),
}), flush=True)
mode = sys.argv[1] if len(sys.argv) > 1 else ""
rank = int(os.environ["DSML_RANK"])
if mode == "exit" and rank == 1:
    sys.exit(3)
if mode == "raise" and rank == 1:
    raise ValueError("boom on rank 1")
if mode == "interrupt" and rank == 1:
    raise KeyboardInterrupt
if mode == "kill" and rank == 1:
    os.kill(os.getpid(), 9)
"""


class Launched:
    """A finished `dsml run`: its exit code, stderr, the launcher's pid and each rank's
    probe in rank order."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        out, self.err = proc.communicate(timeout=60)
        self.code = proc.returncode
        self.pid = proc.pid
        probes = [json.loads(line.split("PROBE ", 1)[1]) for line in out.splitlines()]
        self.probes: list[dict[str, Any]] = sorted(probes, key=lambda p: p["rank"])


def launch(
    tmp_path: Path,
    *args: str,
    n: int = 3,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> Launched:
    """`dsml run -n n probe.py args` with an embedded registry."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    return run_dsml([str(script), *args], n, cwd or tmp_path, **(env or {}))


def run_dsml(argv: list[str], n: int, cwd: Path, **env: str) -> Launched:
    proc = subprocess.Popen(
        [*DSML, "run", "-n", str(n), *argv],
        env={**clean_env(MY_VAR="mine"), **env},
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        return Launched(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(90)
def test_ranks_are_forked_from_one_server_and_share_its_address_layout(tmp_path: Path) -> None:
    run = launch(tmp_path)
    assert run.code == 0, run.err
    probes = run.probes
    assert [p["rank"] for p in probes] == [0, 1, 2]
    assert len({p["ppid"] for p in probes}) == 1  # one server forked them all ...
    assert probes[0]["ppid"] != run.pid  # ... not the launcher
    assert len({p["numpy_at"] for p in probes}) == 1  # numpy mapped once, before the forks
    assert all(p["sid_is_pid"] for p in probes)  # each leads its own session, as before


@pytest.mark.timeout(90)
def test_a_forked_rank_runs_its_script_as_python_would(tmp_path: Path) -> None:
    work = tmp_path / "elsewhere"
    work.mkdir()
    run = launch(tmp_path, "a", "b c", cwd=work)
    assert run.code == 0, run.err
    probes = run.probes
    assert all(p["ppid"] != run.pid for p in probes)  # forked, not started by the launcher
    script = str(tmp_path / "probe.py")
    for p in probes:
        assert p["name"] == "__main__"
        assert p["file"] == script
        assert p["argv"] == [script, "a", "b c"]
        assert p["main_is_module"]  # the script runs in sys.modules["__main__"] itself
        assert p["path0"] == str(tmp_path.resolve())  # the script's folder, not the cwd
        assert p["cwd"] == str(work)
        assert p["mine"] == "mine"
        assert p["stdin"] == ""  # /dev/null, as before
    # random state of their own: numpy's global one too (reseeded after the fork)
    assert len({p["np_draw"] for p in probes}) == 3
    assert len({p["draw"] for p in probes}) == 3


@pytest.mark.timeout(90)
def test_a_forked_ranks_exit_code_and_traceback_are_those_of_python(tmp_path: Path) -> None:
    run = launch(tmp_path, "exit")
    assert all(p["ppid"] != run.pid for p in run.probes)
    assert run.code == 3
    assert "rank 1 failed (exit code 3)" in run.err

    run = launch(tmp_path, "raise")
    assert run.code == 1
    assert "ValueError: boom on rank 1" in run.err
    trace = [line for line in run.err.splitlines() if line.startswith("[rank 1]   File ")]
    assert trace, run.err
    assert all("probe.py" in line for line in trace), trace  # no server or runpy frames


@pytest.mark.timeout(90)
def test_a_forked_rank_ending_by_a_signal_is_reported_so(tmp_path: Path) -> None:
    run = launch(tmp_path, "interrupt")
    assert all(p["ppid"] != run.pid for p in run.probes)
    assert "rank 1 failed (killed by SIGINT)" in run.err, run.err
    assert run.code == 128 + signal.SIGINT
    assert "KeyboardInterrupt" in run.err

    run = launch(tmp_path, "kill")
    assert "rank 1 failed (killed by SIGKILL)" in run.err, run.err
    assert run.code == 128 + signal.SIGKILL


@pytest.mark.timeout(90)
def test_a_module_runs_under_dash_m_from_the_fork_server(tmp_path: Path) -> None:
    package = tmp_path / "probepkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "main.py").write_text(PROBE)
    run = run_dsml(["-m", "probepkg.main", "x"], 2, tmp_path)
    assert run.code == 0, run.err
    probes = run.probes
    assert len(probes) == 2
    for p in probes:
        assert p["name"] == "__main__"
        assert p["argv"] == [str(package / "main.py"), "x"]
        assert p["path0"] == str(tmp_path)
        assert p["main_is_module"]
    assert len({p["ppid"] for p in probes}) == 1
    assert probes[0]["ppid"] != run.pid


@pytest.mark.timeout(90)
def test_another_dsml_in_the_working_directory_is_not_the_one_ranks_run(tmp_path: Path) -> None:
    """`python SCRIPT` does not look in the working directory for its imports; the fork
    server's `python -c` would, and then ranks started in another checkout's folder ran
    that checkout's dsml (benchmarks' before/after runs compared a tree with itself)."""
    other = tmp_path / "other"
    shutil.copytree(ROOT / "dsml", other / "dsml", ignore=shutil.ignore_patterns("__pycache__"))
    script = tmp_path / "which.py"
    script.write_text(
        "import os, dsml\nprint(f'WHICH {os.environ[\"DSML_RANK\"]} {dsml.__file__}', flush=True)\n"
    )
    env = clean_env(MY_VAR="mine")
    plain = subprocess.run(  # what Python itself imports there
        [sys.executable, str(script)],
        env={**env, "DSML_RANK": "0"},
        cwd=other,
        capture_output=True,
        text=True,
        timeout=60,
    )
    expected = plain.stdout.split()[-1]
    assert expected == str(ROOT / "dsml" / "__init__.py"), plain.stderr
    # -P: the launcher itself must not pick the copy up either (it is not the subject)
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "dsml", "run", "-n", "2", str(script)],
        env=env,
        cwd=other,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    lines = sorted(line.split("WHICH ", 1)[1] for line in proc.stdout.splitlines())
    assert lines == [f"0 {expected}", f"1 {expected}"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "env", [{"DSML_FORKSERVER": "0"}, {"OMP_NUM_THREADS": "4"}], ids=["off", "threads"]
)
def test_without_the_fork_server_ranks_are_started_one_by_one(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """Turned off, or refused by a server that has threads (numpy's BLAS with
    OMP_NUM_THREADS > 1: forking it is not safe): the ranks are the launcher's children."""
    run = launch(tmp_path, n=2, env=env)
    assert run.code == 0, run.err
    probes = run.probes
    assert [p["ppid"] for p in probes] == [run.pid, run.pid]  # the launcher's children
    assert all(p["name"] == "__main__" for p in probes)
    assert len({p["np_draw"] for p in probes}) == 2


def test_only_this_pythons_scripts_and_modules_are_forked() -> None:
    py = sys.executable
    assert forkable([py, "train.py", "--lr", "1"], {})
    assert forkable([py, "-m", "pkg.main"], {})
    assert not forkable([py, "-m"], {})
    assert not forkable([py, "-c", "print(1)"], {})
    assert not forkable([py, "-X", "dev", "train.py"], {})
    assert not forkable(["/usr/bin/other-python", "train.py"], {})
    for off in ("0", "false", "no", "OFF"):  # only "0" turned it off
        assert not forkable([py, "train.py"], {"DSML_FORKSERVER": off})
    assert forkable([py, "train.py"], {"DSML_FORKSERVER": "1"})


@pytest.mark.timeout(90)
def test_an_environment_too_large_for_the_server_starts_ranks_one_by_one(tmp_path: Path) -> None:
    """A request is one packet (the socket's buffer, ~200 KiB by default): a larger
    environment makes the launcher start the ranks as separate interpreters instead."""
    big = {f"BIG_{i}": "x" * 110_000 for i in range(10)}  # over the server's 1 MiB too
    run = launch(tmp_path, n=2, env=big)
    assert run.code == 0, run.err
    assert [p["ppid"] for p in run.probes] == [run.pid, run.pid]


SLEEPER = """
import atexit, os, sys, time
atexit.register(lambda: print(f"atexit {os.environ['DSML_RANK']}", flush=True))
print(f"ready {os.getpid()} {os.getppid()}", flush=True)
time.sleep(60)
"""


GRANDCHILD = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with open(sys.argv[1], "a") as f:
    f.write(f"{child.pid} ")
"""


def _start_sleepers(
    tmp_path: Path, n: int = 2, grandchild: bool = False
) -> tuple[subprocess.Popen[str], list[int], int]:
    """`dsml run -n n sleeper.py`, once every rank printed its pid: (launcher, rank pids,
    the pid of their parent). With `grandchild`, each rank first starts a process of its
    own and appends its pid to tmp_path / "grandchildren"."""
    script = tmp_path / "sleeper.py"
    script.write_text((GRANDCHILD if grandchild else "") + SLEEPER)
    proc = subprocess.Popen(
        [*DSML, "run", "-n", str(n), str(script), str(tmp_path / "grandchildren")],
        env=clean_env(),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    parents: set[int] = set()
    assert proc.stdout is not None
    while len(pids) < n:
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        _, pid, parent = line.split("] ", 1)[1].split()
        pids.append(int(pid))
        parents.add(int(parent))
    assert len(parents) == 1
    return proc, pids, parents.pop()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has ended
    except FileNotFoundError:
        return True


@pytest.mark.timeout(90)
def test_ctrl_c_reaches_forked_ranks_which_exit_as_python_does(tmp_path: Path) -> None:
    proc, pids, server = _start_sleepers(tmp_path)
    try:
        assert server != proc.pid  # forked by the server
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "[rank 0] atexit 0" in out
    assert "[rank 1] atexit 1" in out
    assert "KeyboardInterrupt" in err
    assert "forkserver" not in err
    assert "runpy" not in err
    assert all(_gone(pid) for pid in pids)


@pytest.mark.timeout(90)
def test_killing_the_launcher_leaves_no_server_rank_or_process_of_a_rank_behind(
    tmp_path: Path,
) -> None:
    """kill -9 of `dsml run`: the server, the ranks and what the ranks started (a data
    loader's workers, a subprocess: their process group) all end."""
    proc, pids, server = _start_sleepers(tmp_path, grandchild=True)
    children = [int(p) for p in (tmp_path / "grandchildren").read_text().split()]
    assert len(children) == 2
    assert not any(_gone(pid) for pid in children)
    proc.kill()
    proc.wait()
    every = [server, *pids, *children]
    deadline = time.monotonic() + 20
    while not all(_gone(pid) for pid in every) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in every if not _gone(pid)] == []
