"""`dsml run --nnodes` on one host (two launchers, one group), and joining a running group."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dsml
from dsml.launch.job import check_running_group, node_zero_bind
from dsml.launch.nodes import NodeShape, link_address
from dsml.membership import query_status
from dsml.testing import crash, open_local_cluster
from tests.test_launch_launchers import assert_one_group, clean_env, free_port, reports

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"
DSML = [sys.executable, "-m", "dsml"]


def start_node(
    node: int,
    port: int,
    script: str,
    *args: str,
    nprocs: int = 2,
    options: tuple[str, ...] = (),
    **env: str,
) -> subprocess.Popen[str]:
    """`dsml run -n nprocs --nnodes 2 --node-rank node` of a script, registry at port."""
    argv = [*DSML, "run", "-n", str(nprocs), "--nnodes", "2", "--node-rank", str(node), *options]
    return subprocess.Popen(
        [*argv, "--registry", f"tcp://127.0.0.1:{port}", str(SCRIPTS / script), *args],
        env=clean_env(**env),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(*procs: subprocess.Popen[str], timeout: float = 50) -> list[tuple[int, str, str]]:
    """Wait for every launcher; (exit code, stdout, stderr) of each; kills on timeout."""
    try:
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out, err))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def wait_ready(nodes: list[subprocess.Popen[str]]) -> None:
    """Until both ranks of each node (wait_forever.py) joined and wait."""
    for node in nodes:
        assert node.stdout is not None
        ready = [node.stdout.readline() for _ in range(2)]
        assert all("ready" in line for line in ready), ready


def free_port_pair() -> int:
    """A port p with p and p+1 free (the registry and the launchers' link)."""
    for _ in range(100):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two consecutive free ports")


@pytest.mark.multiprocess
def test_dsml_run_nnodes_2_twice_on_one_host_forms_one_group_ranked_by_node() -> None:
    port = free_port_pair()
    node1 = start_node(1, port, "launch_check.py", "RANK")  # either may start first
    node0 = start_node(0, port, "launch_check.py", "RANK")
    (code0, out0, err0), (code1, out1, err1) = finish(node0, node1)
    assert code0 == 0, err0
    assert code1 == 0, err1
    assert_one_group(out0 + out1, 4)
    assert sorted(r["rank"] for r in reports(out0)) == [0, 1]  # type: ignore[type-var]
    assert sorted(r["rank"] for r in reports(out1)) == [2, 3]  # type: ignore[type-var]
    assert f"node 1: waiting for node 0's launcher at tcp://127.0.0.1:{port + 1}" in err1
    assert "waiting for node 0" not in err0


@pytest.mark.multiprocess
def test_a_node_launch_of_another_world_size_is_refused_before_any_rank_starts() -> None:
    port = free_port_pair()
    node0 = start_node(0, port, "launch_check.py", "RANK")
    try:
        wrong = start_node(1, port, "launch_check.py", "RANK", nprocs=3)
        [(code, out, err)] = finish(wrong)
        assert code == 2, out + err
        assert "node 0 launched this job with --nnodes 2 -n 2 (world size 4)" in err
        assert "world size 6" in err
        assert "LAUNCH" not in out  # no rank started
        right = start_node(1, port, "launch_check.py", "RANK")  # the job still forms
        (code0, out0, err0), (code1, out1, err1) = finish(node0, right)
        assert (code0, code1) == (0, 0), err0 + err1
        assert_one_group(out0 + out1, 4)
    finally:
        if node0.poll() is None:
            node0.send_signal(signal.SIGINT)
            finish(node0)


@pytest.mark.multiprocess
def test_a_failing_rank_is_reported_with_its_cause_by_the_launchers_of_every_node() -> None:
    port = free_port_pair()
    node0 = start_node(0, port, "fail_on_rank.py", FAIL_RANK="3")
    node1 = start_node(1, port, "fail_on_rank.py", FAIL_RANK="3")
    results = finish(node0, node1)
    for code, _out, err in results:
        assert code == 1, err
        report = err[err.index("dsml run: rank") :]
        assert report.startswith("dsml run: rank 3 on node 1 ("), report
        assert "failed (exit code 1)" in report
        assert "RuntimeError: rank 3 cannot find its batch" in report


@pytest.mark.multiprocess
@pytest.mark.parametrize("interrupted", [0, 1])
def test_ctrl_c_on_one_node_is_named_as_the_cause_by_every_launcher(interrupted: int) -> None:
    port = free_port_pair()
    nodes = [start_node(n, port, "wait_forever.py") for n in (0, 1)]
    try:
        wait_ready(nodes)
        nodes[interrupted].send_signal(signal.SIGINT)
        results = finish(*nodes)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    other = 1 - interrupted
    code, _, err = results[interrupted]
    assert code == 130, err
    assert "dsml run: interrupted by SIGINT: 2 ranks stopped" in err
    code, _, err = results[other]
    assert code == 130, err  # was 1, naming one of its ranks that failed because of it
    assert f"dsml run: node {interrupted} (" in err, err
    assert "was interrupted by SIGINT; the other ranks were stopped." in err
    assert "failed (exit code" not in err


async def test_check_running_group_refuses_a_launch_of_another_world_size() -> None:
    async with open_local_cluster(2) as cluster:
        await check_running_group(cluster.registry.address, 2)  # the same size: fine
        with pytest.raises(dsml.ConfigError, match=r"world size 2 running.*group of 3"):
            await check_running_group(cluster.registry.address, 3)


async def test_check_running_group_waits_out_a_group_whose_ranks_all_died() -> None:
    """Ranks killed without leaving stay listed until the heartbeat timeout evicts them:
    a launch of another size right after waits for that, not refused for a dead group."""
    fast = dsml.RegistryConfig(heartbeat_interval=0.05, heartbeat_timeout=1.0)
    async with open_local_cluster(2, registry_config=fast) as cluster:
        for comm in cluster:
            await crash(comm)
        await check_running_group(cluster.registry.address, 3)  # no ConfigError
        status = await query_status(cluster.registry.address)
        assert not status["formed"], status


# -- dsml.init(address) without world_size ----------------------------------------------------


async def test_init_without_world_size_joins_the_running_group_at_its_next_boundary() -> None:
    async with open_local_cluster(2) as cluster, dsml.init(cluster.registry.address) as joiner:
        assert (joiner.rank, joiner.world_size) == (2, 3)
        everyone = [*cluster.comms, joiner]
        out = await asyncio.gather(
            *(c.all_reduce(np.full(5, c.rank + 1, dtype=np.int64)) for c in everyone)
        )
        assert all((o == 6).all() for o in out)
        assert [c.world_size for c in everyone] == [3, 3, 3]


async def test_init_without_world_size_and_no_group_running_says_world_size_forms_one() -> None:
    async with dsml.open_registry() as registry:
        with pytest.raises(dsml.ConfigError, match=r"no group is running.*pass world_size=N"):
            await dsml.init(registry.address)


# -- the registry served by rank 0 ------------------------------------------------------------


def _status_from_another_thread(address: str, out: dict[str, Any]) -> threading.Thread:
    def ask() -> None:
        try:
            out["status"] = asyncio.run(query_status(address, registry_timeout=10.0))
        except BaseException as exc:  # handed to the test, which raises it
            out["error"] = exc

    thread = threading.Thread(target=ask)
    thread.start()
    return thread


async def test_rank_zeros_registry_answers_while_its_loop_is_blocked_and_closes_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = free_port()
    for name in [k for k in os.environ if k.startswith(("DSML_", "SLURM_", "PMI", "OMPI_"))]:
        monkeypatch.delenv(name)
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    address = f"tcp://127.0.0.1:{port}"
    async with dsml.init() as comm:
        assert (comm.rank, comm.world_size) == (0, 1)
        answer: dict[str, Any] = {}
        thread = _status_from_another_thread(address, answer)
        deadline = time.monotonic() + 20
        while thread.is_alive() and time.monotonic() < deadline:
            # User code blocking this event loop, as a long numpy call does:
            time.sleep(0.01)  # noqa: ASYNC251
        thread.join()
        assert "error" not in answer, answer
        assert answer["status"]["formed"] is True
        assert len(answer["status"]["members"]) == 1
    with socket.socket() as s:
        # Closed with the communicator: nobody listens there any more (SO_REUSEADDR lets
        # the bind through connections in TIME_WAIT, never past a listening socket).
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()


@pytest.mark.multiprocess
def test_dsml_run_nnodes_with_curve_keys_forms_one_group_over_encrypted_links(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys"
    subprocess.run([*DSML, "keys", "generate", str(keys)], check=True, capture_output=True)
    port = free_port_pair()
    curve = ("--curve-keys", str(keys))
    node0 = start_node(0, port, "launch_check.py", "RANK", options=curve)
    node1 = start_node(1, port, "launch_check.py", "RANK", options=curve)
    (code0, out0, err0), (code1, out1, err1) = finish(node0, node1)
    assert (code0, code1) == (0, 0), err0 + err1
    assert_one_group(out0 + out1, 4)


@pytest.mark.multiprocess
def test_a_node_launch_without_node_zeros_curve_keys_is_refused_at_once(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    subprocess.run([*DSML, "keys", "generate", str(keys)], check=True, capture_output=True)
    port = free_port_pair()
    node0 = start_node(0, port, "launch_check.py", "RANK", options=("--curve-keys", str(keys)))
    try:
        plain = start_node(1, port, "launch_check.py", "RANK")
        [(code, out, err)] = finish(plain)
        assert code == 2, out + err
        assert "Pass the same --curve-keys DIR on every node" in err
        assert "LAUNCH" not in out
    finally:
        node0.send_signal(signal.SIGINT)
        finish(node0)


async def test_rank_zero_whose_master_port_is_taken_says_to_choose_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [k for k in os.environ if k.startswith(("DSML_", "SLURM_", "PMI", "OMPI_"))]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
        for name, value in (env | {"MASTER_PORT": str(taken.getsockname()[1])}).items():
            monkeypatch.setenv(name, value)
        with pytest.raises(dsml.ConfigError, match="Choose another MASTER_PORT"):
            await dsml.init()


def test_node_shapes_give_ranks_by_node_and_refuse_impossible_ones() -> None:
    shape = NodeShape(nnodes=3, nprocs=4, node_rank=2)
    assert (shape.world_size, list(shape.ranks)) == (12, [8, 9, 10, 11])
    with pytest.raises(dsml.ConfigError, match="--node-rank 3 is out of range"):
        NodeShape(3, 4, 3)
    assert link_address("tcp://host0:29500") == "tcp://host0:29501"
    with pytest.raises(dsml.ConfigError, match="fixed port"):
        link_address("ipc:///tmp/registry")


def test_a_registry_nobody_serves_is_named_by_the_launcher_at_once() -> None:
    """The ranks wait for a --registry that is not up yet for their registry timeout (it
    may be starting); the launcher says so at once instead of only their tracebacks 10 s
    later (new-user probe)."""
    port = free_port()
    script = str(SCRIPTS / "wait_forever.py")
    proc = subprocess.Popen(
        [*DSML, "run", "-n", "1", "--registry", f"tcp://127.0.0.1:{port}", script],
        env=clean_env(),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        started = time.monotonic()
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert f"no registry answered at tcp://127.0.0.1:{port}" in line, line
        assert "the ranks wait for it up to their registry timeout" in line.lower(), line
        assert time.monotonic() - started < 8  # the query's 2 s, and the start-up
    finally:
        proc.kill()  # the launcher only (our child); its rank dies with it
        proc.wait()


def test_node_zero_refuses_to_serve_an_address_of_another_host() -> None:
    with pytest.raises(dsml.ConfigError, match="not an address of this host"):
        node_zero_bind("tcp://203.0.113.77:29500")  # TEST-NET-3: nobody's; only a bind is tried


@pytest.mark.timeout(30)
async def test_node_zero_names_the_nodes_it_still_waits_for_and_a_loopback_address(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Node 0's ranks wait in silence for the others until their join timeout; its
    launcher names the missing nodes, and says when its address is a loopback one that
    other hosts cannot reach (a common mistake: --registry tcp://127.0.0.1:... on node 0)."""
    from dsml.launch import node_board, node_link

    monkeypatch.setattr(node_board, "BEAT_S", 0.05)
    monkeypatch.setattr(node_link, "BEAT_S", 0.05)
    monkeypatch.setattr(node_board, "WAITING_S", 0.2)
    monkeypatch.setattr(node_board, "WAITING_AGAIN_S", 0.3)
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    board = node_board.NodeBoard(NodeShape(3, 1, 0), lambda failure: None).open(address)
    try:
        with caplog.at_level("WARNING", logger="dsml.run"):
            await asyncio.sleep(0.6)
            said = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
            assert len(said) >= 2  # and again
            assert f"for nodes 1, 2 of --nnodes 3 to reach this launcher at {address}" in said[0]
            assert "loopback address, which launchers on other hosts cannot reach" in said[0]
            link = await node_link.NodeLink(NodeShape(3, 1, 2), lambda failure: None).open(
                address, timeout_s=5
            )
            try:
                caplog.clear()
                await asyncio.sleep(0.5)
                said = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
                assert said
                assert all("for node 1 of --nnodes 3" in m for m in said), said
            finally:
                await link.aclose()
    finally:
        await board.aclose()
    other = node_board.NodeBoard(NodeShape(2, 1, 0), lambda failure: None)
    other._address = "tcp://10.1.2.3:29501"  # not bound: only the wording
    text = other.waiting(12.0)
    assert "after 12 s for node 1 of --nnodes 2" in text
    assert "loopback" not in text
    assert "same --registry" in text


@pytest.mark.multiprocess
@pytest.mark.parametrize("killed", [0, 1])
def test_a_launcher_killed_is_named_lost_by_the_other_after_its_beats_stop(killed: int) -> None:
    """kill -9 of one node's launcher (as when its host goes down: its ranks die with it,
    by PDEATHSIG). The other launcher stops hearing its beats on the link and, LOST_S
    later, names that node as the cause (it named one of its own ranks, or, with ranks
    that were not in a collective, waited for them forever)."""
    from dsml.launch.nodes import LOST_S

    port = free_port_pair()
    nodes = [start_node(n, port, "wait_forever.py") for n in (0, 1)]
    try:
        wait_ready(nodes)
        killed_at = time.monotonic()
        nodes[killed].kill()
        nodes[killed].communicate()
        [(code, _, err)] = finish(nodes[1 - killed], timeout=LOST_S + 30)
        took = time.monotonic() - killed_at
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.communicate()
    assert code == 1, err
    report = err[err.rindex("dsml run: ") :]
    assert report.startswith(f"dsml run: node {killed} ({socket.gethostname()}) was lost"), err
    assert f"its launcher was not heard from for {LOST_S:g} s" in report
    assert "the other ranks were stopped." in report
    assert LOST_S - 1 <= took < LOST_S + 25, took


@pytest.mark.multiprocess
def test_ranks_outliving_the_group_are_not_stopped_when_node_zero_ends_first() -> None:
    """Node 1's ranks close their communicators, then work on for longer than LOST_S.
    Node 0 ends meanwhile and says so on the link (LAUNCH_DONE): node 1 must not take
    the silence that follows for node 0's loss and stop them."""
    from dsml.launch.nodes import LOST_S

    port = free_port_pair()
    outlive = str(LOST_S + 2)
    nodes = [
        start_node(n, port, "outlive_group.py", outlive, options=("--grace", "1")) for n in (0, 1)
    ]
    (code0, out0, err0), (code1, out1, err1) = finish(*nodes, timeout=LOST_S + 40)
    assert (code0, code1) == (0, 0), err0 + err1
    assert all(f"finished {r}" in out0 for r in (0, 1)), out0
    assert all(f"finished {r}" in out1 for r in (2, 3)), out1
    assert "was lost" not in err1, err1
