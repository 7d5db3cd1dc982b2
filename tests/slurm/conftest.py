"""A throw-away Slurm cluster for the tests in this folder (see tests/harness/slurm.py).

Three namespaced hosts: `ctl` runs slurmctld and srun (a login node), `n1` and `n2` run a
slurmd each and declare 2 CPUs, so `srun -N2 -n4` puts tasks 0-1 on n1 and 2-3 on n2.
One cluster serves the whole module; it is stopped, daemon by daemon, at its end.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness import slurm
from tests.harness.netns import close_hosts, open_hosts


@pytest.fixture(scope="module")
def slurm_cluster() -> Iterator[slurm.SlurmCluster]:
    reason = slurm.unavailable_reason()
    if reason:
        pytest.skip(reason)
    hosts = open_hosts(3, names=["ctl", "n1", "n2"])
    try:
        with slurm.open_slurm(hosts, cpus=2) as cluster:
            print(f"Slurm cluster up in {cluster.started_s:.2f} s: {cluster!r}")
            yield cluster
    finally:
        close_hosts(hosts)
