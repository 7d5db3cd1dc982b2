"""`dsml worker` as a process: startup, signals, status, CURVE and the bind rule."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

import dsml
from dsml.daemon import Client
from dsml.transport import generate_keys, prove_secret

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]

DSML = [sys.executable, "-m", "dsml"]


class Proc:
    """A `dsml ...` child process whose first output line is its startup line."""

    def __init__(self, *argv: str) -> None:
        self.popen = subprocess.Popen(
            [*DSML, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        self.line = self.popen.stdout.readline().strip()

    @property
    def address(self) -> str:
        return self.line.split(" serving on ", 1)[1].split()[0]

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.communicate(timeout=10)


@pytest.fixture
def procs():
    started: list[Proc] = []

    def start(*argv: str) -> Proc:
        proc = Proc(*argv)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


async def _wait_listed(client: Client, n: int) -> None:
    deadline = time.monotonic() + 10
    while len([w for w in await client.workers() if w.state == "idle"]) < n:
        assert time.monotonic() < deadline, "workers not listed"
        await asyncio.sleep(0.05)


def test_non_loopback_bind_without_curve_is_refused_with_a_reason(procs):
    result = subprocess.run(
        [*DSML, "worker", "--registry", "tcp://127.0.0.1:9", "--bind", "tcp://0.0.0.0:0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "refusing to serve on tcp://0.0.0.0:0 without CURVE" in result.stderr
    assert "dsml keys generate" in result.stderr


@pytest.mark.parametrize(
    ("device", "says"),
    [
        ("tpu", "device='tpu' is not a device name"),
        # no cupy here: named; with cupy but no GPU, or too few GPUs: said so
        ("cuda:7", "cupy|no CUDA GPU is visible|does not exist"),
    ],
)
def test_a_worker_checks_its_device_at_startup_not_in_every_job(device, says):
    """Before, `--device cuda` without cupy started, was listed idle, and failed each job."""
    result = subprocess.run(
        [*DSML, "worker", "--registry", "tcp://127.0.0.1:9", "--device", device],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert re.search(says, result.stderr), result.stderr
    assert "serving on" not in result.stdout


def test_local_cluster_refuses_a_device_name_it_does_not_know():
    with pytest.raises(dsml.ConfigError, match="not a device name"):
        dsml.LocalCluster(1, device="tpu")


def test_worker_without_a_registry_exits_with_a_clear_error():
    result = subprocess.run(
        [*DSML, "worker", "--registry", "tcp://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "tcp://127.0.0.1:9" in result.stderr


async def test_sigterm_deregisters_and_exits_zero_and_status_lists_workers(procs):
    registry = procs("registry", "--address", "tcp://127.0.0.1:0")
    address = registry.line.rsplit(" ", 1)[-1]
    worker = procs("worker", "--registry", address, "--name", "alpha")
    assert worker.line.startswith("dsml worker alpha serving on tcp://127.0.0.1:")
    async with Client(address) as client:
        await _wait_listed(client, 1)
        status = await asyncio.to_thread(
            subprocess.run,
            [*DSML, "status", "--registry", address],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert "worker daemons: 1 idle, 0 busy" in status.stdout
        assert "alpha" in status.stdout
        assert worker.address in status.stdout

        worker.popen.send_signal(signal.SIGTERM)
        assert worker.popen.wait(timeout=10) == 0
        assert await client.workers() == []  # it said goodbye; no heartbeat timeout needed


async def test_second_signal_forces_exit_of_a_blocked_worker(procs):
    registry = procs("registry", "--address", "tcp://127.0.0.1:0")
    address = registry.line.rsplit(" ", 1)[-1]
    worker = procs("worker", "--registry", address)
    async with Client(address) as client:
        await _wait_listed(client, 1)
        job = asyncio.create_task(client.run(lambda comm: time.sleep(30)))
        await asyncio.sleep(1.0)  # the plain function now blocks the daemon's loop
        worker.popen.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        assert worker.popen.poll() is None  # the first signal waits for the job to end
        worker.popen.send_signal(signal.SIGTERM)
        assert worker.popen.wait(timeout=5) == 128 + signal.SIGTERM
        with pytest.raises(dsml.WorkerLostError):
            await job


async def test_malformed_bytes_on_the_job_socket_do_not_disturb_the_worker(procs):
    registry = procs("registry", "--address", "tcp://127.0.0.1:0")
    address = registry.line.rsplit(" ", 1)[-1]
    worker = procs("worker", "--registry", address)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    prove_secret(sock, b"garbage")  # the job's secret: a buggy client, not an outsider
    sock.connect(worker.address)
    for frames in ([b"garbage"], [b"\x93\x01\x1e\x00", b"x"], [b"\xc1" * 100, b"", b""]):
        sock.send_multipart(frames)
    sock.close(linger=1000)
    async with Client(address) as client:
        await _wait_listed(client, 1)
        assert await client.run(lambda comm: comm.world_size) == [1]


def _touch(comm, path):
    Path(path).write_text("executed")
    return comm.rank


async def test_curve_runs_jobs_only_for_allowlisted_clients(procs, tmp_path):
    keys = tmp_path / "keys"
    generate_keys(keys)
    registry = procs("registry", "--address", "tcp://127.0.0.1:0", "--curve-keys", str(keys))
    address = registry.line.rsplit(" ", 1)[-1]
    procs("worker", "--registry", address, "--curve-keys", str(keys))
    procs("worker", "--registry", address, "--curve-keys", str(keys))

    # A stranger with the cluster's public server key but a key pair of its own.
    stranger = tmp_path / "stranger"
    generate_keys(stranger)
    shutil.copy(keys / "server.key", stranger / "server.key")

    async with Client(address, curve_keys=keys) as client:
        await _wait_listed(client, 2)
        marker = tmp_path / "allowed"
        assert await client.run(_touch, str(marker)) == [0, 1]
        assert marker.read_text() == "executed"
        x = np.arange(4.0)
        assert (await client.run(_sum, x))[0].tolist() == [0.0, 2.0, 4.0, 6.0]

        async with Client(address, curve_keys=stranger, connect_timeout=2.0) as intruder:
            with pytest.raises(dsml.RegistryUnavailableError):
                await intruder.workers()  # the registry does not hear it either
            listed = await client.workers()

            async def listing():
                return listed

            intruder.workers = listing  # it learnt the addresses some other way
            forbidden = tmp_path / "forbidden"
            with pytest.raises(dsml.RemoteError):
                await intruder.run(_touch, str(forbidden))
            assert not forbidden.exists()
        assert await client.run(lambda comm: comm.rank) == [0, 1]  # still serving


async def _sum(comm, x):
    return await comm.all_reduce(x)


def test_an_embedded_daemon_also_refuses_a_non_loopback_bind_without_curve():
    from dsml.daemon import WorkerConfig

    with pytest.raises(dsml.ConfigError, match="without CURVE"):
        WorkerConfig(registry="tcp://127.0.0.1:9", bind="tcp://0.0.0.0:0")
    with pytest.raises(dsml.ConfigError, match="without CURVE"):
        WorkerConfig(registry="tcp://127.0.0.1:9", bind="tcp://localhost.example.com:0")


async def test_a_malformed_submission_is_refused_with_the_reason():
    from dsml.daemon import WorkerConfig, WorkerDaemon
    from dsml.transport import Channel
    from dsml.wire import Envelope, Kind

    daemon = await WorkerDaemon(WorkerConfig(registry="tcp://127.0.0.1:9")).start()
    replies: asyncio.Queue = asyncio.Queue()
    channel = Channel.connect(
        daemon.address, b"client-test", handler=lambda s, env, p: replies.put_nowait(env)
    )
    try:
        body = {"job": "j1", "rank": 0, "world_size": 0}
        await channel.send(Envelope(Kind.JOB_SUBMIT, body=body), [b"x"])
        reply = await asyncio.wait_for(replies.get(), 5)
        assert reply.kind is Kind.JOB_REFUSED
        assert "malformed submission" in reply.body["reason"]
        assert not daemon.busy
    finally:
        await channel.aclose(linger_s=0)
        await daemon.aclose()
