"""IPv6 wherever an address goes: parsing and formatting `tcp://[v6]:port`, resolving,
routing and binding by family, and whole groups over ::1 (`dsml run`, launcher variables).

The multi-host IPv6-only run is in tests/multihost/test_ipv6_hosts.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dsml.communicator.session import host_keys
from dsml.errors import ConfigError
from dsml.launch import Hosting, choose_bind, resolve_rendezvous
from dsml.launch.job import node_zero_bind
from dsml.launch.nodes import link_address
from dsml.membership import Member, View
from dsml.transport import addresses, check_address, is_loopback
from dsml.transport.addresses import (
    advertised,
    format_tcp,
    interface_address,
    is_local_address,
    is_loopback_host,
    resolve_host,
    route_to,
    split_tcp,
    wants_ipv6,
)
from tests.harness.procs import joined_output
from tests.test_launch_launchers import clean_env

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "scripts" / "ipv6_check.py")


def _has_ipv6_loopback() -> bool:
    with socket.socket(socket.AF_INET6) as s:
        try:
            s.bind(("::1", 0))
        except OSError:
            return False
    return True


needs_v6 = pytest.mark.skipif(not _has_ipv6_loopback(), reason="this host cannot bind ::1")


# -- parsing and formatting ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "host", "port"),
    [
        ("tcp://127.0.0.1:5555", "127.0.0.1", "5555"),
        ("tcp://[::1]:5611", "::1", "5611"),
        ("tcp://[fd00:217:44::3]:0", "fd00:217:44::3", "0"),
        ("tcp://[::]:*", "::", "*"),
        ("tcp://node-3.cluster:29500", "node-3.cluster", "29500"),
        ("tcp://*:7000", "*", "7000"),
        ("tcp://eth0:7000", "eth0", "7000"),
    ],
)
def test_split_tcp_gives_the_unbracketed_host_and_the_port(
    address: str, host: str, port: str
) -> None:
    assert split_tcp(address) == (host, port)
    assert format_tcp(host, port) == address


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("tcp://::1:5555", r"write an IPv6 address in brackets, e\.g\. tcp://\[::1\]:5555"),
        ("tcp://[::1]5555", "needs a host and a port"),
        ("tcp://[::1]", "needs a host and a port"),
        ("tcp://[::1:5555", "needs a host and a port"),
        ("tcp://host", "needs a host and a port"),
        ("tcp://:5555", "needs a host and a port"),
        ("tcp://[]:5555", "needs a host and a port"),
        ("tcp://[::1]:70000", "a port is 0-65535"),
        ("tcp://h:port", "needs a host and a port"),
        ("udp://h:1", "is not a tcp://host:port address"),
    ],
)
def test_malformed_tcp_addresses_are_config_errors_that_say_what_to_write(
    address: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        split_tcp(address, "--registry")
    if address.startswith("tcp://"):
        with pytest.raises(ConfigError, match="--registry"):
            check_address(address, "--registry")


def test_check_address_accepts_bracketed_ipv6_and_ipc() -> None:
    assert check_address("tcp://[::1]:5611", "registry") == "tcp://[::1]:5611"
    assert check_address("ipc:///tmp/r", "registry") == "ipc:///tmp/r"


def test_zmq_takes_ipv6_for_v6_literals_the_wildcard_and_v6_only_names_only() -> None:
    assert wants_ipv6("tcp://[::1]:1")
    assert wants_ipv6("tcp://*:1")
    assert not wants_ipv6("tcp://127.0.0.1:1")
    assert not wants_ipv6("tcp://localhost:1")  # has an IPv4 address: libzmq would try ::1
    assert not wants_ipv6("ipc:///tmp/r")


# -- resolving, loopback, routes -------------------------------------------------------------


def test_resolve_host_keeps_literals_and_strips_brackets() -> None:
    assert resolve_host("[::1]", "test") == "::1"
    assert resolve_host("::1", "test") == "::1"
    assert resolve_host("10.0.0.5", "test") == "10.0.0.5"
    assert resolve_host("localhost", "test") == "127.0.0.1"  # a v4 address wins
    with pytest.raises(ConfigError, match=r"cannot resolve host 'no-such-host\.invalid' \(x\)"):
        resolve_host("no-such-host.invalid", "x")


def test_loopback_checks_know_ipv6_loopback() -> None:
    assert is_loopback("tcp://[::1]:5555")
    assert is_loopback("tcp://[::ffff:127.0.0.1]:5555")
    assert not is_loopback("tcp://[fd00::1]:5555")
    assert not is_loopback("tcp://[::]:5555")
    assert is_loopback_host("::1")
    assert is_loopback_host("[::1]")
    assert not is_loopback_host("fd00::1")


@needs_v6
def test_route_and_local_address_use_the_family_of_the_peer() -> None:
    assert route_to("::1") == "::1"
    assert route_to("[::1]") == "::1"
    assert route_to("127.0.0.1") == "127.0.0.1"
    assert is_local_address("::1")
    assert not is_local_address("fd00:217:44::99")
    assert advertised("tcp://[::]:7000", toward="tcp://[::1]:5555") == "tcp://[::1]:7000"
    assert advertised("tcp://*:7000", toward="tcp://[::1]:5555") == "tcp://[::1]:7000"
    assert advertised("tcp://[::1]:7000") == "tcp://[::1]:7000"


# -- binding and launcher variables ----------------------------------------------------------


@needs_v6
def test_a_v6_loopback_registry_makes_workers_bind_v6_loopback() -> None:
    assert choose_bind(None, None, "tcp://[::1]:5555") == "tcp://[::1]:0"
    assert choose_bind(None, None, "tcp://127.0.0.1:5555") == "tcp://127.0.0.1:0"
    assert choose_bind("tcp://[::1]:7", None, "tcp://127.0.0.1:5555") == "tcp://[::1]:7"


@needs_v6
def test_dsml_ifname_picks_the_interfaces_v6_address_for_a_v6_registry() -> None:
    assert interface_address("lo", socket.AF_INET6) == "::1"
    assert interface_address("lo") == "127.0.0.1"
    assert choose_bind(None, "lo", "tcp://[::1]:5555") == "tcp://[::1]:0"
    assert choose_bind(None, "lo", "tcp://127.0.0.1:5555") == "tcp://127.0.0.1:0"


@pytest.mark.parametrize(
    ("lines", "want"),
    [
        (
            [
                "fe800000000000000000000000000001 01 40 20 80 lo",
                "fd000217004400000000000000000003 01 40 00 80 lo",
            ],
            "fd00:217:44::3",
        ),
        (["fe800000000000000000000000000001 01 40 20 80 lo"], "fe80::1%lo"),
        (["fd000217004400000000000000000003 02 40 00 80 eth9"], None),
    ],
)
def test_dsml_ifname_skips_link_local_v6_unless_it_is_the_only_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lines: list[str], want: str | None
) -> None:
    table = tmp_path / "if_inet6"
    table.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(addresses, "_IF_INET6", str(table))
    if want is None:
        with pytest.raises(ConfigError, match="'lo' has no usable IPv6 address"):
            interface_address("lo", socket.AF_INET6)
    else:
        assert interface_address("lo", socket.AF_INET6) == want


def test_master_addr_v6_gives_a_bracketed_registry_address() -> None:
    for written in ("::1", "[::1]"):
        env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": written, "MASTER_PORT": "29611"}
        plan = resolve_rendezvous(None, None, None, env)
        assert plan.hosting is Hosting.SERVE
        assert plan.registry == "tcp://[::1]:29611"
        assert plan.registry_host == "::1"


def test_node_link_and_node_zero_bind_keep_v6_brackets() -> None:
    assert link_address("tcp://[::1]:5611") == "tcp://[::1]:5612"
    assert link_address("tcp://[fd00::2]:29400") == "tcp://[fd00::2]:29401"
    with pytest.raises(ConfigError, match=r"tcp://\[ADDR\]:PORT"):
        link_address("tcp://::1:5611")
    if _has_ipv6_loopback():
        assert node_zero_bind("tcp://[::1]:5611") == "tcp://[::1]:5611"
    with pytest.raises(ConfigError, match=r"\[fd00:217:44::99\] .* is not an address of this"):
        node_zero_bind("tcp://[fd00:217:44::99]:5611")


def test_ranks_advertising_v6_loopback_count_as_one_host() -> None:
    members = [Member(f"m{i}", f"tcp://[::1]:{7000 + i}", host="h") for i in range(3)]
    members.append(Member("m3", "tcp://127.0.0.1:7003", host="h"))
    keys = host_keys(View(1, tuple(members)))
    assert keys[:3] == ["h/::1"] * 3
    assert keys[3] == "h/127.0.0.1"


# -- whole groups over ::1 -------------------------------------------------------------------


def _free_v6_port() -> int:
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        return int(s.getsockname()[1])


def _reports(output: str) -> list[dict[str, object]]:
    marker = "IPV6 "
    return [
        json.loads(line[line.index(marker) + 5 :]) for line in output.splitlines() if marker in line
    ]


def _assert_group_over_v6(output: str, n: int) -> list[dict[str, object]]:
    found = _reports(output)
    assert sorted(r["rank"] for r in found) == list(range(n)), output  # type: ignore[type-var]
    for report in found:
        assert report["world_size"] == n, report
        assert report["exact"] is True, report
        assert str(report["address"]).startswith("tcp://[::1]:"), report
    return found


@needs_v6
@pytest.mark.multiprocess
@pytest.mark.parametrize("shm", ["1", "0"])
def test_dsml_run_with_a_v6_registry_forms_a_group_over_v6_loopback(shm: str) -> None:
    port = _free_v6_port()
    address = f"tcp://[::1]:{port}"
    env = clean_env(DSML_SHM=shm)
    dsml = [sys.executable, "-m", "dsml"]
    registry = subprocess.Popen(
        [*dsml, "registry", "--address", address],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert registry.stdout is not None
        assert address in registry.stdout.readline()  # "dsml registry serving on ..."
        done = subprocess.run(
            [*dsml, "run", "-n", "4", "--registry", address, SCRIPT],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=50,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        found = _assert_group_over_v6(done.stdout, 4)
        ran = {str(r["ran"]) for r in found} | {str(r["shm_ran"]) for r in found}
        if shm == "1":  # ranks advertising [::1] are known to share the host
            assert {str(r["shm_ran"]) for r in found} == {"shm"}, found
        else:  # the data went over TCP on ::1
            assert not any("shm" in a or "hier" in a for a in ran), ran
    finally:
        registry.terminate()
        registry.wait(10)


@needs_v6
@pytest.mark.multiprocess
def test_launcher_variables_with_master_addr_v6_form_one_group_over_v6() -> None:
    port = _free_v6_port()
    procs = [
        subprocess.Popen(
            [sys.executable, SCRIPT],
            env=clean_env(
                RANK=str(rank),
                WORLD_SIZE="4",
                MASTER_ADDR="::1",
                MASTER_PORT=str(port),
                DSML_SHM="0",
            ),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(4)
    ]
    output = joined_output(procs)
    _assert_group_over_v6(output, 4)


def _free_v6_port_pair() -> int:
    """A port p with p and p+1 free on ::1 (the registry and the launchers' link)."""
    for _ in range(50):
        port = _free_v6_port()
        with socket.socket(socket.AF_INET6) as s:
            try:
                s.bind(("::1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no free port pair on ::1")


@needs_v6
@pytest.mark.multiprocess
def test_dsml_run_nnodes_2_over_v6_loopback_with_curve_forms_one_group(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    env = clean_env()
    dsml = [sys.executable, "-m", "dsml"]
    subprocess.run([*dsml, "keys", "generate", str(keys)], env=env, check=True, capture_output=True)
    address = f"tcp://[::1]:{_free_v6_port_pair()}"
    secure = ["--curve-keys", str(keys), "--registry", address]
    nodes = [
        subprocess.Popen(
            [*dsml, "run", "-n", "2", "--nnodes", "2", "--node-rank", str(node), *secure, SCRIPT],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    output = joined_output(nodes)
    _assert_group_over_v6(output, 4)


@needs_v6
@pytest.mark.multiprocess
def test_torch_process_group_under_master_addr_v6_runs_every_call() -> None:
    pytest.importorskip("torch")
    port = _free_v6_port()
    script = str(ROOT / "tests" / "scripts" / "torch_collectives.py")
    ranks = [
        subprocess.Popen(
            [sys.executable, script],
            env=clean_env(
                RANK=str(rank),
                WORLD_SIZE="2",
                LOCAL_RANK=str(rank),
                MASTER_ADDR="::1",  # torch's store and rank 0's registry both on [::1]
                MASTER_PORT=str(port),
            ),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        for proc in ranks:
            out, err = proc.communicate(timeout=80)
            assert proc.returncode == 0, out + err
            assert out.split()[-1:] == ["ok"], out + err
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
