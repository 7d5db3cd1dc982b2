"""Hierarchical all_reduce on real hosts: two ranks on each of two namespaced hosts.

Ranks of one host share its memory (same host name, advertised address and boot id);
the hosts reach each other only over their shaped links. `algorithm="hierarchical"`
must run as such (shared memory in each host, a ring between hosts) and give the exact
sums and maxima that the plain ring gives (tests/multihost/hier_worker.py checks them).
"""

from __future__ import annotations

import pytest

from dsml.testing.netns import NetnsHosts
from tests.harness.netns import PYTHON, Procs, child_env

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
            [
                PYTHON,
                "-m",
                "dsml",
                "run",
                "-n",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                str(host.index),
                "--registry",
                registry,
                "tests/multihost/hier_worker.py",
            ],
            child_env(DSML_SHM="1"),
        )
        for host in two
    ]
    assert procs.wait_exit(timeout=60) == [0, 0], procs.report()
    calls = [event for launcher in launchers for event in launcher.of("ok")]
    assert len(calls) == 4 * 2 * 3 * 2, procs.report()  # ranks x algorithms x sizes x ops
    assert all(call["exact"] for call in calls), procs.report()
    assert {c["ran"] for c in calls if c["algorithm"] == "hierarchical"} == {"hierarchical"}
    assert {c["ran"] for c in calls if c["algorithm"] == "ring"} == {"ring"}
    for launcher in launchers:
        assert len(launcher.of("done")) == 2, procs.report()
