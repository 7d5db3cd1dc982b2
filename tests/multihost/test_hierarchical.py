"""Hierarchical all_reduce on real hosts: two ranks on each of two namespaced hosts.

Ranks of one host share its memory (same host name, advertised address and boot id);
the hosts reach each other only over their shaped links. `algorithm="hierarchical"`
must run as such (shared memory in each host, a ring between hosts) and give the exact
sums and maxima that the plain ring gives (tests/multihost/hier_worker.py checks them);
and a rank killed in the middle of hierarchical calls fails the call on every survivor,
who then go on exactly without it (three ranks on two hosts: over TCP).
"""

from __future__ import annotations

import signal
import time

import pytest

from dsml.testing.netns import NetnsHosts
from tests.harness.netns import PYTHON, Procs, child_env, dsml_run_argv

pytestmark = pytest.mark.multiprocess

PORT = "29500"  # inside the test's own namespaces: no other run can hold it


def test_hierarchical_all_reduce_across_two_hosts_of_two_ranks_is_exact(
    hosts: NetnsHosts, procs: Procs
):
    registry = f"tcp://{hosts[0].address}:{PORT}"
    two = hosts[:2]
    launchers = [
        procs.start(
            host,
            dsml_run_argv(2, 2, host.index, registry, ["tests/multihost/hier_worker.py"]),
            child_env(DSML_SHM="1"),
        )
        for host in two
    ]
    assert procs.wait_exit(timeout=60) == [0, 0], procs.report()
    calls = [event for launcher in launchers for event in launcher.of("ok")]
    assert len(calls) == 4 * 3 * 3 * 2, procs.report()  # ranks x algorithms x sizes x ops
    assert all(call["exact"] for call in calls), procs.report()
    assert {c["ran"] for c in calls if c["algorithm"] == "hierarchical"} == {"hierarchical"}
    assert {c["ran"] for c in calls if c["algorithm"] == "ring"} == {"ring"}
    auto: dict[tuple[int, str], set[str]] = {}
    for c in calls:
        if c["algorithm"] == "auto":
            auto.setdefault((c["n"], c["op"]), set()).add(c["ran"])
    print("auto ran:", auto)
    assert all(len(ran) == 1 for ran in auto.values()), auto  # one choice, on every rank
    for launcher in launchers:
        assert len(launcher.of("done")) == 2, procs.report()


def test_kill_9_in_a_hierarchical_all_reduce_fails_every_survivor_then_they_go_on(
    hosts: NetnsHosts, procs: Procs
):
    loop = [
        PYTHON,
        "tests/multihost/worker.py",
        "--until-lost",
        "--after-lost",
        "2",
        "--mib",
        "4",
        "--algorithm",
        "hierarchical",
    ]
    workers = [
        procs.start(
            hosts[rank // 2],
            loop,
            child_env(
                DSML_SHM="1",
                MASTER_ADDR=hosts[0].address,
                MASTER_PORT=PORT,
                RANK=str(rank),
                WORLD_SIZE="4",
            ),
        )
        for rank in range(4)
    ]
    procs.wait_until(lambda: all(len(w.of("ok")) >= 2 for w in workers), "two calls on all")
    victim, survivors = workers[3], workers[:3]  # h1's second rank
    killed_at = time.time()
    victim.proc.send_signal(signal.SIGKILL)
    procs.wait_until(lambda: all(w.of("done") for w in survivors), "the survivors done")
    assert victim.proc.wait(5) == -signal.SIGKILL
    for survivor in survivors:
        before = survivor.of("ok")[:2]
        assert [(e["size"], e["ran"], e["exact"]) for e in before] == [
            (4, "hierarchical", True)
        ] * 2
        seen = survivor.of("lost") + survivor.of("shrunk")
        assert seen, procs.report()
        assert seen[0].get("lost", [3]) == [3], procs.report()
        first = seen[0]["i"] + (seen[0]["event"] == "lost")
        after = [e for e in survivor.of("ok") if e["i"] >= first]
        assert [(e["size"], e["exact"]) for e in after] == [(3, True), (3, True)], procs.report()
        print(f"{survivor.host.name}: {seen[0]['event']} {seen[0]['t'] - killed_at:.2f} s after")
    assert [w.proc.wait(10) for w in survivors] == [0, 0, 0], procs.report()
