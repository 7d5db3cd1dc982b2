"""The dsml command, through real processes: run, bench, status, registry."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dsml
from tests.procs import dsml_registry

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
DSML = [sys.executable, "-m", "dsml"]

pytestmark = pytest.mark.multiprocess


def standalone_registry() -> contextlib.AbstractContextManager[str]:
    """A `dsml registry` process on a free port; yields its address; stopped by SIGTERM."""
    return dsml_registry(stop_within=10)


def status_after_job(address: str) -> dict:
    """`dsml status --json` once the job's group has ended there, or after 4 s.

    The ranks' leave messages and this query reach the registry on different connections,
    so a query made the moment the launcher returns may be served first (seen on a loaded
    2-core machine). 4 s is well under the registry's 10 s heartbeat timeout: a rank that
    never left is still seen as a member then, and the caller's assertions fail."""
    deadline = time.monotonic() + 4.0
    while True:
        report = json.loads(dsml_cmd("status", "--registry", address, "--json").stdout)
        if not report["formed"] or time.monotonic() > deadline:
            return report
        time.sleep(0.1)


def start_waiting_ranks(
    n: int, script: str = "wait_forever.py", *options: str
) -> tuple[subprocess.Popen[str], list[int]]:
    """`dsml run -n N script` once every rank said it is ready; (process, pids)."""
    proc = subprocess.Popen(
        [*DSML, "run", "-n", str(n), *options, str(SCRIPTS / script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    pids: list[int] = []
    while len(pids) < n:
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        if "ready" in line:
            pids.append(int(line.split()[-1]))
    return proc, pids


def dsml_cmd(*args: str, timeout: float = 60, env: dict[str, str] | None = None):
    return subprocess.run(
        [*DSML, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def test_version_and_help_work_for_every_subcommand():
    assert dsml_cmd("--version").stdout.strip() == f"dsml {dsml.__version__}"
    for sub in ([], ["registry"], ["run"], ["bench"], ["status"]):
        result = dsml_cmd(*sub, "--help")
        assert result.returncode == 0, result.stderr
        assert "usage: dsml" in result.stdout


def test_run_starts_the_example_with_rank_prefixed_output():
    result = dsml_cmd("run", "-n", "4", "examples/hello_all_reduce.py")
    assert result.returncode == 0, result.stderr
    for rank in range(4):
        assert f"[rank {rank}] rank {rank}/4: all_reduce(sum) of " in result.stdout
        assert "-> [6.0, 10.0, 14.0, 18.0]" in result.stdout
    assert "every element is 1.0" in result.stdout


def test_run_gives_each_rank_the_variables_torchrun_users_expect():
    result = dsml_cmd("run", "-n", "3", str(SCRIPTS / "show_env.py"), env={"OMP_NUM_THREADS": ""})
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line.split("] ", 1)[1]) for line in result.stdout.splitlines()]
    by_rank = {int(r["RANK"]): r for r in rows}
    assert sorted(by_rank) == [0, 1, 2]
    for rank, row in by_rank.items():
        assert row["LOCAL_RANK"] == str(rank)
        assert row["WORLD_SIZE"] == row["LOCAL_WORLD_SIZE"] == row["DSML_WORLD_SIZE"] == "3"
        assert row["comm_rank"] == rank  # dsml.init() honours the launcher's rank
        assert row["comm_world_size"] == 3
        assert row["OMP_NUM_THREADS"] == "1"
        assert row["DSML_REGISTRY"].startswith("tcp://127.0.0.1:")


def test_run_keeps_a_thread_count_the_user_chose():
    result = dsml_cmd("run", "-n", "2", str(SCRIPTS / "show_env.py"), env={"OMP_NUM_THREADS": "3"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.count('"OMP_NUM_THREADS": "3"') == 2


def _cpus_of_ranks(n: int, cpus: set[int], *bind: str) -> dict[int, list[int]]:
    """Run show_cpus.py as n ranks from a launcher restricted to `cpus`."""
    result = subprocess.run(
        [*DSML, "run", "-n", str(n), *bind, str(SCRIPTS / "show_cpus.py")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
    )
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line.split("] ", 1)[1]) for line in result.stdout.splitlines()]
    return {row["rank"]: row["cpus"] for row in rows}


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")
def test_run_binds_ranks_to_one_cpu_each_only_when_they_outnumber_the_cpus():
    cpus = sorted(os.sched_getaffinity(0))[:2]
    n = len(cpus) + 1  # more ranks than CPUs: rank i on CPU i modulo their number
    assert _cpus_of_ranks(n, set(cpus)) == {i: [cpus[i % len(cpus)]] for i in range(n)}
    unbound = _cpus_of_ranks(n, set(cpus), "--cpu-bind", "none")
    assert unbound == dict.fromkeys(range(n), cpus)
    assert _cpus_of_ranks(1, set(cpus)) == {0: cpus}  # as many CPUs as ranks: left alone


def test_spread_gives_each_of_fewer_ranks_its_own_block_of_cpus(monkeypatch):
    from dsml.launch import rank_setup

    monkeypatch.setattr(rank_setup.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6})
    assert rank_setup.cpu_sets(3, "spread") == [{0, 1}, {2, 3}, {4, 5}]
    assert rank_setup.cpu_sets(3, "auto") is None
    assert rank_setup.cpu_sets(9, "auto") == [{i % 7} for i in range(9)]
    assert rank_setup.cpu_sets(9, "none") is None
    with pytest.raises(ValueError, match="cpu_bind must be one of"):
        rank_setup.cpu_sets(2, "cores")


def test_a_failing_rank_stops_the_job_and_is_named_with_its_error():
    start = time.monotonic()
    result = dsml_cmd("run", "-n", "4", str(SCRIPTS / "fail_on_rank.py"), env={"FAIL_RANK": "2"})
    elapsed = time.monotonic() - start
    assert result.returncode == 1
    assert "dsml run: rank 2 failed (exit code 1)" in result.stderr
    assert "RuntimeError: rank 2 cannot find its batch" in result.stderr
    assert elapsed < 30  # stopped, not waiting for the collective timeout (120 s)


@pytest.mark.parametrize("shm", ["0", "1"])
def test_a_rank_that_blocks_its_loop_is_the_one_the_launcher_names(shm):
    """The rank named was a bystander that a prober had made give the call up (and the
    prober, still waiting for the hung rank's answer, was stopped before it could say);
    in shared memory, a live rank after the hung one was reported as silent too."""
    script = str(SCRIPTS / "hang_rank.py")
    result = dsml_cmd("run", "-n", "4", script, env={"HANG_RANK": "1", "DSML_SHM": shm})
    assert result.returncode == 1, result.stderr[-3000:]
    summary = result.stderr.rsplit("dsml run: rank", 1)[1]
    assert "CollectiveTimeoutError" in summary, summary
    assert "rank 1 did not answer" in summary, summary
    assert "gave it up" not in summary, summary


def test_run_m_gives_the_module_every_argument_after_it(tmp_path):
    """`-m MODULE -n 7 --epochs 3` started 7 ranks (dsml took -n) or refused --epochs."""
    package = tmp_path / "argsprobe"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "show.py").write_text(
        "import json, os, sys\nprint(json.dumps([sys.argv[1:], os.environ['DSML_WORLD_SIZE']]))\n"
    )
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    result = dsml_cmd("run", "-n", "1", "-m", "argsprobe.show", "-n", "7", "--epochs", "3", env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.split("] ", 1)[1]) == [["-n", "7", "--epochs", "3"], "1"]
    joined = dsml_cmd("run", "-n", "1", "-margsprobe.show", "-n", "7", "-mx", env=env)
    assert joined.returncode == 0, joined.stderr  # -mMODULE in one word, as python takes it
    assert json.loads(joined.stdout.split("] ", 1)[1]) == [["-n", "7", "-mx"], "1"]
    missing = dsml_cmd("run", "-n", "1", "-m")
    assert missing.returncode == 2
    assert "-m needs a MODULE" in missing.stderr


def test_bad_launch_flags_are_refused_before_any_rank_starts():
    """A bad --registry started every rank, each printing a traceback; --grace -1 and
    bench sizes below one element were taken silently."""
    for args, says in (
        (["run", "-n", "2", "--registry", "notanaddr", "x.py"], "--registry 'notanaddr'"),
        (["run", "-n", "2", "--grace", "-1", "x.py"], "--grace must be 0 or more"),
        (["bench", "-n", "2", "--sizes", "3"], "not a whole number of float32 elements"),
        (["bench", "-n", "2", "--iters", "-1"], "--iters must be at least 1"),
    ):
        result = dsml_cmd(*args, timeout=30)
        assert result.returncode == 2, (args, result.stderr)
        assert says in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr + result.stdout


def test_interrupting_the_launcher_reaches_every_rank_and_ends_them():
    proc, pids = start_waiting_ranks(2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert out.count("interrupted") == 2
    assert "dsml run: interrupted by SIGINT: 2 ranks stopped\n" in err, err
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_bench_prints_json_rows_with_consistent_bandwidths():
    result = dsml_cmd(
        "bench",
        "-n",
        "2",
        "--sizes",
        "4K,64K",
        "--algorithm",
        "ring,tree",
        "--iters",
        "3",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert {(r["bytes"], r["algorithm"]) for r in rows} == {
        (4096, "ring"),
        (4096, "tree"),
        (65536, "ring"),
        (65536, "tree"),
    }
    for row in rows:
        assert set(row) >= {
            "bytes",
            "world_size",
            "algorithm",
            "op",
            "median_s",
            "algbw_GBps",
            "busbw_GBps",
        }
        assert row["median_s"] > 0
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / row["median_s"] / 1e9)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * 1 / 2)


@pytest.mark.parametrize(("shm", "chosen"), [("1", "shm"), ("0", "tree")])
def test_bench_table_has_a_header_and_one_row_per_measurement_naming_what_auto_chose(shm, chosen):
    """Two ranks of one host: auto runs in shared memory (the default), or, with
    DSML_SHM=0, the cost model's choice for 4 KiB over TCP (the tree)."""
    result = dsml_cmd("bench", "-n", "2", "--sizes", "4K", "--iters", "2", env={"DSML_SHM": shm})
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines[0].startswith("# dsml bench: world_size=2")
    assert "busbw(GB/s)" in lines[1]
    assert lines[2].split()[:2] == ["4096", f"auto({chosen})"]


def test_status_exits_1_when_no_registry_answers():
    result = dsml_cmd("status", "--registry", "tcp://127.0.0.1:9", "--wait", "0.5")
    assert result.returncode == 1
    assert "no registry answered" in result.stderr


def test_help_gives_one_default_per_flag_and_registry_from_the_environment_is_optional():
    for sub in ("run", "bench", "status"):
        text = " ".join(dsml_cmd(sub, "--help").stdout.split())
        help_of = text.split("--registry REGISTRY", 2)[-1].split(" --", 1)[0]
        assert help_of.count("default:") == 1, (sub, help_of)
        assert "$DSML_REGISTRY" in help_of, (sub, help_of)
        assert "[--registry REGISTRY]" in text, sub  # the usage line: not required
    missing = dsml_cmd("status", env={"DSML_REGISTRY": ""})
    assert missing.returncode == 2
    assert "no registry: pass --registry" in missing.stderr
    assert "DSML_REGISTRY" in missing.stderr


def test_a_port_that_answers_but_is_no_registry_is_named_as_such():
    """Something that accepts TCP but speaks no ZeroMQ: "start one there" would fail."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        busy = dsml_cmd("status", "--registry", address, "--wait", "0.5")
    assert busy.returncode == 1
    assert "something listens on that port but did not answer as a dsml registry" in busy.stderr
    assert "Start one with" not in busy.stderr
    free = dsml_cmd("status", "--registry", "tcp://127.0.0.1:9", "--wait", "0.5")
    assert "nothing listens there. Start one with `dsml registry" in free.stderr


def test_the_hint_of_a_missing_registry_knows_dsml_registry_is_exported():
    """Exported, DSML_REGISTRY is --registry's default: leaving the flag out is not enough."""
    script = str(ROOT / "examples" / "hello_all_reduce.py")
    env = {"DSML_REGISTRY": "tcp://127.0.0.1:9", "DSML_REGISTRY_TIMEOUT": "1"}
    result = dsml_cmd("run", "-n", "1", script, env=env, timeout=120)
    assert result.returncode != 0
    assert "unset DSML_REGISTRY and leave --registry out" in result.stderr, result.stderr[-2000:]


def test_a_standalone_registry_serves_runs_and_status_then_stops_on_sigterm():
    with standalone_registry() as address:
        idle = dsml_cmd("status", "--registry", address)
        assert idle.returncode == 0, idle.stderr
        assert ": no group yet," in idle.stdout  # it said "group forming, ... world size 0"
        run = dsml_cmd("run", "-n", "2", "--registry", address, "examples/hello_all_reduce.py")
        assert run.returncode == 0, run.stderr
        report = status_after_job(address)
        # formed at epoch 1; the first rank to leave made epoch 2 (of the one left), the
        # last one ended the group
        assert report["epoch"] == 2
        assert report["formed"] is False
        assert report["members"] == []
        after = dsml_cmd("status", "--registry", address)
        assert "no group running (the last one's epoch: 2)" in after.stdout, after.stdout


def test_a_registry_serves_the_next_job_after_a_job_whose_rank_failed():
    """Stopped ranks leave the group (SIGINT, not SIGTERM), so the registry is reusable."""
    with standalone_registry() as address:
        failed = dsml_cmd(
            "run",
            "-n",
            "3",
            "--registry",
            address,
            str(SCRIPTS / "fail_on_rank.py"),
            env={"FAIL_RANK": "1"},
        )
        assert failed.returncode == 1
        assert "dsml run: rank 1 failed" in failed.stderr
        ok = dsml_cmd("run", "-n", "2", "--registry", address, "examples/hello_all_reduce.py")
        assert ok.returncode == 0, ok.stderr
        report = status_after_job(address)
        assert report["formed"] is False
        assert report["epoch"] >= 2


def test_sigterm_to_the_launcher_lets_every_rank_close():
    proc, _ = start_waiting_ranks(2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert out.count("interrupted") == 2  # each rank got KeyboardInterrupt and closed


def test_ranks_that_ignore_the_stop_signal_are_killed_after_the_grace_period():
    proc, pids = start_waiting_ranks(2, "ignore_sigint.py", "--grace", "1")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)  # would hang if the launcher waited forever
    assert proc.returncode == 128 + signal.SIGTERM  # 143, as a shell reports SIGTERM
    assert "interrupted by SIGTERM: 2 ranks stopped, 2 of them killed" in err, err
    assert "(SIGKILL after --grace 1 s)" in err
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_engine_example_runs_the_lecture_program_on_four_ranks():
    result = dsml_cmd("run", "-n", "4", "examples/engine_lecture.py")
    assert result.returncode == 0, result.stderr
    for rank in range(4):
        a = 2 * (rank + 1)
        line = f"[rank {rank}] rank {rank}: A={a} B=allreduce(A)=20 C=A+1={a + 1} D=A*B={a * 20}"
        assert line in result.stdout


def test_output_without_newlines_and_progress_bars_reach_the_launcher_intact():
    result = dsml_cmd("run", "-n", "1", str(SCRIPTS / "long_line.py"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert sum(line.count("x") for line in lines) == 200 * 1024
    assert "[rank 0] progress 999" in lines  # what a terminal would have shown
    assert lines[-1] == "[rank 0] done"
