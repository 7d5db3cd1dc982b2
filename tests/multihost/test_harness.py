"""The namespaced hosts themselves: addresses, names, shaping, teardown, one dsml group.

The group test sets every address by hand (DSML_REGISTRY, DSML_RANK, DSML_BIND), so it
checks the harness with nothing but what dsml had before launcher variables.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from dsml.testing.netns import (
    NetnsHosts,
    leftover_namespaces,
    measure_rate,
    netns_hosts,
    tbf_args,
)
from tests.harness.netns import PYTHON, Procs, child_env, open_hosts

pytestmark = pytest.mark.multiprocess

CONNECT = (
    "import socket, sys; s = socket.create_connection((sys.argv[1], 9000), timeout=5); "
    "print(s.recv(64).decode())"
)
SERVE = (
    "import socket; s = socket.create_server(('0.0.0.0', 9000)); print('ready', flush=True); "
    "c, a = s.accept(); c.sendall(socket.gethostname().encode() + b' saw ' + a[0].encode())"
)


def test_each_host_has_its_name_address_and_a_tbf_shaped_link_both_ways(hosts: NetnsHosts):
    for host in hosts:
        out = host.run(["sh", "-c", "hostname; ip -4 -o addr show dev eth0"]).stdout
        name, addr = out.splitlines()
        assert name == host.name
        assert f"inet {host.address}/24" in addr
        host_side = host.run(["tc", "qdisc", "show", "dev", "eth0"]).stdout
        bridge_side = subprocess.run(
            ["tc", "-n", hosts.bridge_netns, "qdisc", "show", "dev", host.port],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert re.search(r"qdisc tbf .* rate 1Gbit ", host_side), host_side
        assert re.search(r"qdisc tbf .* rate 1Gbit ", bridge_side), bridge_side
    hosts[2].set_rate("10gbit")
    assert "rate 10Gbit" in hosts[2].run(["tc", "qdisc", "show", "dev", "eth0"]).stdout
    assert "rate 1Gbit" in hosts[1].run(["tc", "qdisc", "show", "dev", "eth0"]).stdout


def test_a_1gbit_link_carries_no_more_than_1gbit_per_second(hosts: NetnsHosts):
    # An upper bound only: a loaded machine can make the stream slower, never faster.
    rate = measure_rate(hosts[0], hosts[1], n_bytes=32 << 20)
    print(f"h0 -> h1 at 1gbit: {rate / 1e9:.3f} Gbit/s")
    assert 0 < rate < 1.1e9


def test_hosts_reach_each_other_by_name_over_the_bridge(hosts: NetnsHosts):
    server = hosts[3].popen([PYTHON, "-c", SERVE], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    assert server.stdout.readline().strip() == "ready"
    out = hosts[0].run([PYTHON, "-c", CONNECT, "h3"], timeout=10).stdout
    assert out.strip() == f"h3 saw {hosts[0].address}"


def test_a_host_cannot_reach_the_machines_loopback(hosts: NetnsHosts):
    # Every host has a loopback of its own: a server on h1's 127.0.0.1 is not h0's.
    server = hosts[1].popen(
        [PYTHON, "-c", SERVE.replace("0.0.0.0", "127.0.0.1")], stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None
    assert server.stdout.readline().strip() == "ready"
    refused = hosts[0].run([PYTHON, "-c", CONNECT, "127.0.0.1"], check=False, timeout=10)
    assert refused.returncode != 0
    assert "ConnectionRefusedError" in refused.stderr


def running(pid: int) -> bool:
    """Whether `pid` is alive (a zombie waiting for init to reap it is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_closing_removes_every_namespace_and_kills_what_ran_there():
    hosts = open_hosts(2, rate="10gbit")
    try:
        sleeper = hosts[0].popen(["sleep", "60"])
        # A process that left the command's session, as a daemon's helpers do:
        escaper = hosts[1].run(
            ["sh", "-c", "setsid sleep 60 >/dev/null 2>&1 & echo $!"], timeout=10
        )
        escaped = int(escaper.stdout)
        made = hosts.namespaces
        assert set(made) <= set(leftover_namespaces(os.getpid()))
        assert len(made) == 3, made  # two hosts and the bridge
    finally:
        hosts.close()
    assert sleeper.wait(5) == -9
    assert not running(escaped)
    assert not set(made) & set(leftover_namespaces(os.getpid()))
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in made)


def test_a_failed_build_removes_what_it_had_made():
    hosts = NetnsHosts(2, rate="1gbit", names=["a", "b"])
    hosts._hosts[1] = hosts._hosts[0]  # the same namespace twice: the second add fails
    with pytest.raises(Exception, match="ip netns add"):
        hosts.open()
    assert not set(hosts.namespaces) & set(leftover_namespaces(os.getpid()))


def test_a_bad_rate_is_refused_before_anything_is_built():
    with pytest.raises(ValueError, match="rate must look like"), netns_hosts(2, rate="fast"):
        pass
    assert tbf_args("10gbit")[:3] == ["tbf", "rate", "10gbit"]


def test_workers_on_four_hosts_form_one_group_with_explicit_dsml_variables(
    hosts: NetnsHosts, procs: Procs
):
    registry = f"tcp://{hosts[0].address}:29400"
    procs.start(
        hosts[0],
        [PYTHON, "-m", "dsml", "registry", "--address", registry],
        child_env(),
    )
    workers = [
        procs.start(
            host,
            [PYTHON, "tests/multihost/worker.py", "--calls", "2"],
            child_env(
                DSML_REGISTRY=registry,
                DSML_WORLD_SIZE="4",
                DSML_RANK=str(3 - host.index),
                DSML_BIND=f"tcp://{host.address}:0",
            ),
        )
        for host in hosts
    ]
    procs.wait_until(lambda: all(w.of("done") for w in workers), "four workers done")
    for worker in workers:
        (joined,) = worker.of("joined")
        assert joined["rank"] == 3 - worker.host.index
        assert joined["size"] == 4
        assert joined["host"] == worker.host.name
        if joined["address"] is not None:
            assert joined["address"].startswith(f"tcp://{worker.host.address}:")
        assert [e["exact"] for e in worker.of("ok")] == [True, True], procs.report()
