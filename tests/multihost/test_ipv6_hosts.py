"""Four namespaced hosts addressed by IPv6 only (no IPv4 on their links): one group of
four, one rank per host, exact all_reduce results.

The registry's address is written bracketed, `tcp://[fd00:217:44::1]:29400`. Two ranks
find their address from the route to the registry (a UDP socket of the registry's
family), two from DSML_IFNAME=eth0, whose only global address is IPv6.
"""

from __future__ import annotations

from dsml.testing.netns import NetnsHosts
from tests.harness.netns import PYTHON, Procs, child_env, dsml_run_argv

PORT = 29400


def test_four_ipv6_only_hosts_form_one_group_with_exact_results(hosts6: NetnsHosts, procs: Procs):
    registry = hosts6[0].tcp(PORT)
    assert registry == "tcp://[fd00:217:44::1]:29400"
    procs.start(hosts6[0], [PYTHON, "-m", "dsml", "registry", "--address", registry], child_env())
    workers = [
        procs.start(
            host,
            [PYTHON, "tests/multihost/worker.py", "--calls", "3"],
            child_env(
                DSML_REGISTRY=registry,
                DSML_WORLD_SIZE="4",
                DSML_RANK=str(host.index),
                DSML_SHM="0",
                **({"DSML_IFNAME": "eth0"} if host.index >= 2 else {}),
            ),
        )
        for host in hosts6
    ]
    procs.wait_until(lambda: all(w.of("done") for w in workers), "four IPv6 workers done")
    for worker in workers:
        (joined,) = worker.of("joined")
        assert joined["rank"] == worker.host.index
        assert joined["size"] == 4
        assert joined["address"].startswith(f"tcp://[{worker.host.address}]:"), joined
        assert [e["exact"] for e in worker.of("ok")] == [True] * 3, procs.report()
        assert {e["size"] for e in worker.of("ok")} == {4}


def test_dsml_run_nnodes_4_over_ipv6_only_hosts_forms_one_group(hosts6: NetnsHosts, procs: Procs):
    registry = hosts6[0].tcp(PORT)
    nodes = [
        procs.start(
            host,
            dsml_run_argv(
                1, 4, host.index, registry, ["tests/multihost/worker.py", "--calls", "2"]
            ),
            child_env(),
        )
        for host in hosts6
    ]
    assert procs.wait_exit(60.0) == [0, 0, 0, 0], procs.report()
    ranks = []
    for node in nodes:
        (joined,) = node.of("joined")
        ranks.append(joined["rank"])
        assert joined["size"] == 4
        assert joined["address"].startswith(f"tcp://[{node.host.address}]:"), joined
        assert [e["exact"] for e in node.of("ok")] == [True, True], procs.report()
    assert ranks == [0, 1, 2, 3]
