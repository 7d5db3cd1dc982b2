"""Launcher variables alone form one group across four namespaced hosts.

Each host runs its own processes with only what a launcher would set there: no DSML_*
variable and no DSML_BIND, so `dsml.init()` must find the registry from the launcher's
variables and bind the interface that routes to it (the hosts' loopbacks are separate).
Every rank reduces integer-valued arrays and checks the exact sum (tests/multihost/worker.py).

Launchers: `dsml run --nnodes` (one per host), real torchrun (two hosts), and the variables
of torchrun/PyTorchJob (MASTER_*, RANK, WORLD_SIZE) and of Slurm (SLURM_*) set by hand;
tests/slurm runs a real srun. Then faults across hosts: kill -9 of a rank, and of rank 0
(the registry's host), and a rank that raises, whose cause every host's launcher reports.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from dsml.testing.netns import NetnsHosts
from tests.harness.netns import PYTHON, Event, Proc, Procs, child_env, dsml_run_argv

pytestmark = pytest.mark.multiprocess

WORKER = [PYTHON, "tests/multihost/worker.py"]
PORT = "29500"  # inside the test's own namespaces: no other run can hold it


def check_group(workers: list[Proc], procs: Procs, ranks: list[int], world: int) -> None:
    """Every worker joined one group of `world` with its expected rank; sums exact."""
    procs.wait_until(lambda: all(w.of("done") for w in workers), "every rank done")
    joined = [w.of("joined")[0] for w in workers]
    assert [j["rank"] for j in joined] == ranks, procs.report()
    assert {j["size"] for j in joined} == {world}
    for worker, event in zip(workers, joined, strict=True):
        assert event["host"] == worker.host.name
        if event["address"] is not None:  # advertised on the host's own interface
            assert event["address"].startswith(f"tcp://{worker.host.address}:"), event
        assert [e["exact"] for e in worker.of("ok")] == [True, True], procs.report()


def test_dsml_run_with_one_launcher_per_host_forms_one_group(hosts: NetnsHosts, procs: Procs):
    registry = f"tcp://{hosts[0].address}:{PORT}"
    launchers = [
        procs.start(
            host,
            dsml_run_argv(2, 4, host.index, registry, [*WORKER[1:], "--calls", "2"]),
            child_env(),
        )
        for host in hosts
    ]
    assert procs.wait_exit() == [0, 0, 0, 0], procs.report()
    for launcher in launchers:
        joined = launcher.of("joined")
        node = launcher.host.index
        assert sorted(j["rank"] for j in joined) == [2 * node, 2 * node + 1], procs.report()
        assert {j["size"] for j in joined} == {8}
        assert {j["host"] for j in joined} == {launcher.host.name}
        assert len(launcher.of("ok")) == 4
        assert all(e["exact"] for e in launcher.of("ok")), procs.report()


def test_env_style_variables_alone_form_one_group(hosts: NetnsHosts, procs: Procs):
    ranks = [2, 0, 3, 1]  # rank 0 (the registry's host) is on h1, not the first host
    master = hosts[ranks.index(0)].address
    workers = [
        procs.start(
            host,
            [*WORKER, "--calls", "2"],
            child_env(
                MASTER_ADDR=master,
                MASTER_PORT=PORT,
                RANK=str(ranks[host.index]),
                WORLD_SIZE="4",
                LOCAL_RANK="0",
                LOCAL_WORLD_SIZE="1",
            ),
        )
        for host in hosts
    ]
    check_group(workers, procs, ranks, 4)


def test_torchrun_on_two_hosts_forms_one_group_through_its_agent_store(
    hosts: NetnsHosts, procs: Procs
):
    pytest.importorskip("torch", reason="torchrun comes with torch (pip install dsml[torch])")
    torchrun = Path(PYTHON).with_name("torchrun")
    two = list(hosts)[:2]
    workers = [
        procs.start(
            host,
            [
                str(torchrun),
                "--nnodes",
                "2",
                "--node-rank",
                str(host.index),
                "--nproc-per-node",
                "2",
                "--master-addr",
                hosts[0].address,
                "--master-port",
                PORT,
                *WORKER[1:],
                "--calls",
                "2",
            ],
            child_env(),
        )
        for host in two
    ]
    assert procs.wait_exit(timeout=50.0) == [0, 0], procs.report()
    for worker in workers:
        joined = worker.of("joined")
        node = worker.host.index
        assert sorted(j["rank"] for j in joined) == [2 * node, 2 * node + 1], procs.report()
        assert all(j["rank"] == int(j["env"]["RANK"]) for j in joined)
        assert {j["size"] for j in joined} == {4}
        assert [e["exact"] for e in worker.of("ok")] == [True] * 4, procs.report()


def test_slurm_style_variables_alone_form_one_group(hosts: NetnsHosts, procs: Procs):
    # What srun -N4 -n4 would set: the registry goes to task 0 on the first node of the
    # step (h0), reached by its name; its port is derived from the job id.
    workers = [
        procs.start(
            host,
            [*WORKER, "--calls", "2"],
            child_env(
                SLURM_PROCID=str(host.index),
                SLURM_NTASKS="4",
                SLURM_LOCALID="0",
                SLURM_NODEID=str(host.index),
                SLURM_STEP_NODELIST="h[0-3]",
                SLURM_JOB_ID="4242",
            ),
        )
        for host in hosts
    ]
    check_group(workers, procs, [0, 1, 2, 3], 4)


def start_until_lost(hosts: NetnsHosts, procs: Procs, after_lost: int) -> list[Proc]:
    """Env-style ranks 0-3 on h0-h3 reducing until one is lost, then `after_lost` calls."""
    loop = [*WORKER, "--until-lost", "--after-lost", str(after_lost), "--mib", "4"]
    return [
        procs.start(
            host,
            loop,
            child_env(
                MASTER_ADDR=hosts[0].address,
                MASTER_PORT=PORT,
                RANK=str(host.index),
                WORLD_SIZE="4",
            ),
        )
        for host in hosts
    ]


def loss_seen(worker: Proc) -> Event | None:
    """The event by which a survivor learnt of the loss: a failed call, or rarely (when it
    was between two calls then) a smaller view before its next call."""
    seen = worker.of("lost") + worker.of("shrunk")
    return seen[0] if seen else None


def kill_and_wait_for_loss(workers: list[Proc], procs: Procs, victim: int, until: str) -> None:
    """kill -9 rank `victim` mid-loop; wait for event `until` (or "loss": `loss_seen`) on
    the others; check what they say about the loss."""
    procs.wait_until(lambda: all(len(w.of("ok")) >= 2 for w in workers), "two calls on all")
    survivors = [w for i, w in enumerate(workers) if i != victim]
    killed_at = time.time()
    workers[victim].proc.send_signal(signal.SIGKILL)

    def reached(w: Proc) -> bool:
        return bool(loss_seen(w) if until == "loss" else w.of(until))

    procs.wait_until(lambda: all(reached(w) for w in survivors), f"{until} on the survivors")
    assert workers[victim].proc.wait(5) == -signal.SIGKILL
    for survivor in survivors:
        seen = loss_seen(survivor)
        assert seen is not None, procs.report()
        assert seen.get("lost", [victim]) == [victim], procs.report()
        assert all(e["exact"] for e in survivor.of("ok"))
        print(f"{survivor.host.name}: {seen['event']} {seen['t'] - killed_at:.2f} s after")


def test_kill_9_of_one_hosts_rank_is_detected_on_the_others_and_they_go_on(
    hosts: NetnsHosts, procs: Procs
):
    workers = start_until_lost(hosts, procs, after_lost=2)
    kill_and_wait_for_loss(workers, procs, victim=2, until="done")
    survivors = [w for i, w in enumerate(workers) if i != 2]
    for survivor in survivors:
        seen = loss_seen(survivor)
        assert seen is not None
        first = seen["i"] + (seen["event"] == "lost")  # a failed call is not retried
        after = [e for e in survivor.of("ok") if e["i"] >= first]
        assert [(e["size"], e["exact"]) for e in after] == [(3, True), (3, True)], procs.report()
    assert [w.proc.wait(10) for w in survivors] == [0, 0, 0], procs.report()


def test_kill_9_of_rank_0_which_hosts_the_registry_is_detected_on_the_other_hosts(
    hosts: NetnsHosts, procs: Procs
):
    workers = start_until_lost(hosts, procs, after_lost=0)
    kill_and_wait_for_loss(workers, procs, victim=0, until="loss")
    assert [w.proc.wait(10) for w in workers[1:]] == [0, 0, 0], procs.report()


def test_a_failing_rank_is_reported_with_its_cause_by_every_hosts_launcher(
    hosts: NetnsHosts, procs: Procs
):
    registry = f"tcp://{hosts[0].address}:{PORT}"
    launchers = [
        procs.start(
            host,
            [
                PYTHON,
                "-m",
                "dsml",
                "run",
                "-n",
                "1",
                "--nnodes",
                "4",
                "--node-rank",
                str(host.index),
                "--registry",
                registry,
                "tests/scripts/fail_on_rank.py",
            ],
            child_env(FAIL_RANK="2"),
        )
        for host in hosts
    ]
    codes = procs.wait_exit()
    assert all(code != 0 for code in codes), procs.report()
    for launcher in launchers:
        # which rank, its exit code, then the last lines it wrote: on every host
        out = launcher.output()
        summary = re.search(r"^dsml run: .*rank 2\b.*exit code 1.*$", out, re.MULTILINE)
        assert summary, procs.report()
        assert "RuntimeError: rank 2 cannot find its batch" in out[summary.end() :]
