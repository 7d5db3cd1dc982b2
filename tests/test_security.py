"""Outsiders cannot change a result (issue 33): every attack with real processes.

The legitimate processes get the job secret (`DSML_SECRET`, or `dsml run`'s own); the
attacker, a separate process, knows everything else (ids, addresses, epochs) but not the
secret. See docs/security.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

import dsml
from dsml.daemon import Client
from dsml.membership import query_status
from dsml.testing import open_local_cluster
from dsml.transport import Endpoint, job_secret, prove_secret
from dsml.transport.secret import JobSecret
from dsml.wire import Envelope, Fingerprint, Kind, encode
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"
WORLD = 3


def _env(secret: str | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DSML_SECRET", "DSML_SECRET_FILE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if secret is not None:
        env["DSML_SECRET"] = secret
    return env | extra


# -- forged collective data ------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("secret", ["DSML_SECRET", "dsml run's own"])
def test_identity_squatting_with_forged_chunks_changes_no_result(tmp_path, secret):
    """World 3, naive over TCP: an outsider squats rank 0's identity at ranks 1 and 2 and
    floods forged chunks; every rank still gets exactly 6 in every one of 15 calls."""
    given = dsml.transport.secret.make_secret() if secret == "DSML_SECRET" else None
    env = _env(given, DSML_SHM="0", XDG_CONFIG_HOME=str(tmp_path / "ranks-config"))
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dsml",
            "run",
            "-n",
            str(WORLD),
            str(SCRIPTS / "secure_ranks.py"),
            str(tmp_path),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # The attacker's own secret (another user's per-user file): not the job's.
    attacker_env = _env(None, XDG_CONFIG_HOME=str(tmp_path / "attacker-config"))
    attacker = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "squatter.py"), str(tmp_path), str(WORLD)],
        env=attacker_env,
    )
    try:
        out, _ = run.communicate(timeout=150)
        assert run.returncode == 0, out
        attacker.wait(timeout=60)
    finally:
        for proc in (run, attacker):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(WORLD)]
    for rank, result in enumerate(results):
        assert result["results"] == [[6.0] * 4] * 15, f"rank {rank}: {result['results']}"
    observed = json.loads((tmp_path / "squatter.json").read_text())
    assert observed["sent"] > 0, observed
    assert observed["handshakes_ok"] == 0, observed  # not one connection got through
    assert observed["handshakes_failed"] >= 1, observed
    assert not observed["status_reply"], "the registry answered an outsider"
    assert results[1]["refused"] >= 1, results
    assert results[2]["refused"] >= 1, results


# -- a fake worker daemon; the registry's memory ------------------------------------------------


def _start(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsml", *args], env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    return proc, line.rsplit(" ", 1)[-1].strip()


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


FAKE_DAEMONS = r"""
import sys, time, zmq
from dsml.wire import Envelope, Kind, encode
registry, victim = sys.argv[1], sys.argv[2]
ctx = zmq.Context()
socks = []
for s in range(64):
    sock = ctx.socket(zmq.DEALER); sock.linger = 0; sock.sndhwm = 10_000
    sock.identity = f"worker-evil{s}".encode()
    sock.connect(registry); socks.append(sock)
time.sleep(0.5)
for i in range(4096):
    hello = {"id": f"evil{i}", "name": "0-evil", "address": "tcp://127.0.0.1:1",
             "device": "cpu", "host": "evil", "pid": 1, "state": "idle", "job": "",
             "jobs_done": 0}
    try:
        socks[i % 64].send(encode(Envelope(Kind.WORKER_HELLO, body=hello)), zmq.NOBLOCK)
        socks[i % 64].send(encode(Envelope(Kind.STATUS_REQUEST)), zmq.NOBLOCK)
    except zmq.Again:
        pass
bye = ctx.socket(zmq.DEALER); bye.linger = 0
bye.identity = f"worker-{victim}.bye".encode(); bye.connect(registry)
bye.send(encode(Envelope(Kind.WORKER_BYE, body={"id": victim})))
time.sleep(3)
print("done", flush=True)
"""


@pytest.mark.timeout(180)
async def test_a_fake_daemon_is_neither_listed_nor_sent_a_job_and_the_registry_stays_small(
    tmp_path,
):
    secret = job_secret().export()  # this test process is the job's client
    env = _env(secret)
    registry, address = _start(["registry", "--address", "tcp://127.0.0.1:0"], env)
    worker = subprocess.Popen(  # noqa: ASYNC220 (started once; nothing else runs yet)
        [sys.executable, "-m", "dsml", "worker", "--registry", address, "--name", "real"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    attacker = None
    try:
        async with Client(address) as client:
            listed = await _listed(address)
            real_id = listed[0]["id"]
            before = _rss_mb(registry.pid)
            # A member's own connection that asks 3,000 times and never reads.
            reader = zmq.Context.instance().socket(zmq.DEALER)
            reader.linger = 0
            reader.rcvhwm, reader.rcvbuf = 1, 4096  # so the registry's own queue fills
            prove_secret(reader, b"status-slow-reader")
            reader.connect(address)
            for _ in range(3000):
                reader.send(encode(Envelope(Kind.STATUS_REQUEST)))
            attacker = subprocess.Popen(  # noqa: ASYNC220 (returns at once)
                [sys.executable, "-c", FAKE_DAEMONS, address, real_id],
                env=_env("another-job-secret-0123456789"),
                stdout=subprocess.PIPE,
                text=True,
            )
            await asyncio.to_thread(attacker.communicate, timeout=120)
            status = await query_status(address)
            names = [w["name"] for w in status["workers"]]
            assert names == ["real"], names
            assert await client.run(lambda comm: (comm.world_size, os.getpid()), workers=1) == [
                (1, worker.pid)
            ]
            grown = _rss_mb(registry.pid) - before
            assert grown < 200, f"the registry grew by {grown:.0f} MB"
            # What it does not read stays in at most 256 queued replies and the kernel's
            # buffers; the rest are dropped and counted (status["undelivered_replies"]).
            reader.close(0)
    finally:
        for proc in (worker, registry, attacker):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


async def _listed(address: str) -> list[dict]:
    async with asyncio.timeout(60):
        while True:
            workers = (await query_status(address))["workers"]
            if workers:
                return workers
            await asyncio.sleep(0.1)


async def test_a_daemon_speaks_only_for_itself():
    """With the secret, a connection named worker-a still cannot list or de-list worker b."""
    async with dsml.open_registry("tcp://127.0.0.1:0") as registry:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.linger = 0
        prove_secret(sock, b"worker-a")
        sock.connect(registry.address)
        hello = {
            "id": "b",
            "name": "b",
            "address": "tcp://127.0.0.1:1",
            "device": "cpu",
            "host": "h",
            "pid": 1,
            "state": "idle",
            "job": "",
            "jobs_done": 0,
        }
        sock.send(encode(Envelope(Kind.WORKER_HELLO, body=hello)))
        sock.send(encode(Envelope(Kind.WORKER_HELLO, body=hello | {"id": "a", "name": "a"})))
        await eventually(lambda: registry.pool.listing(), "the hello of worker a", 10)
        await eventually(lambda: registry.dropped_messages, "the hello for b, dropped", 10)
        assert [w["name"] for w in registry.pool.listing()] == ["a"]
        assert registry.dropped_messages == 1
        sock.close(0)


# -- no message from a connection that did not authenticate reaches a handler ------------------


class _Flood:
    """Raw sockets of a private context that do not prove the secret, or lie about who
    they are: random identities, mechanisms and frames."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.ctx = zmq.Context()
        self.socks: list[zmq.Socket] = []
        self.impostor_messages = 0
        self._impostors: set[int] = set()

    def open(self, address: str, count: int) -> None:
        wrong = JobSecret(b"another-job-secret-0123456789", "attacker")
        for i in range(count):
            sock = self.ctx.socket(zmq.DEALER)
            sock.linger = 0
            identity = self.rng.randbytes(self.rng.randint(1, 40)).lstrip(b"\0") or b"x"
            kind = i % 3
            if kind == 0:
                sock.identity = identity  # no credentials at all
            elif kind == 1:
                prove_secret(sock, identity, wrong)  # another job's secret
            else:  # the job's secret, but sending under someone else's routing identity
                identity = identity.hex().encode()  # a name that can authenticate (UTF-8)
                prove_secret(sock, identity)
                sock.identity = b"member-" + identity
                self._impostors.add(len(self.socks))
            sock.connect(address)
            self.socks.append(sock)

    def frames(self) -> list[bytes]:
        rng = self.rng
        if rng.random() < 0.5:
            kind = rng.choice(list(Kind))
            fp = Fingerprint("all_reduce") if rng.random() < 0.5 else None
            env = Envelope(kind, rng.randint(0, 3), rng.randint(0, 50), 1, 0, 0, fp)
            return [encode(env), rng.randbytes(rng.randint(0, 64))]
        return [rng.randbytes(rng.randint(0, 100)) for _ in range(rng.randint(1, 4))]

    def send(self, messages: int) -> int:
        sent = 0
        for _ in range(messages):
            index = self.rng.randrange(len(self.socks))
            try:
                self.socks[index].send_multipart(self.frames(), zmq.NOBLOCK)
            except zmq.Again:
                continue
            sent += 1
            self.impostor_messages += index in self._impostors
        return sent

    def close(self) -> None:
        for sock in self.socks:
            sock.close(0)
        self.ctx.term()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_no_unauthenticated_message_reaches_an_endpoints_handler(seed):
    """3 x 3,000 random messages from 60 sockets each: only the proven one is handled."""
    handled: list[bytes] = []
    endpoint = Endpoint.bind(
        "tcp://127.0.0.1:0", lambda s, e, p: handled.append(s), max_frame_bytes=1 << 20
    )
    flood = _Flood(seed)
    try:
        flood.open(endpoint.address, 60)
        await asyncio.sleep(0.3)  # handshakes (refused or not) under way
        for _ in range(30):
            flood.send(100)
            await asyncio.sleep(0)
        await eventually(
            lambda: endpoint.impostors >= flood.impostor_messages, "the impostors' messages", 20
        )
        legit = zmq.Context.instance().socket(zmq.DEALER)
        legit.linger = 0
        prove_secret(legit, b"member-ok")
        legit.connect(endpoint.address)
        legit.send_multipart([encode(Envelope(Kind.PING))])
        await eventually(lambda: handled, "the proven message", 20)
        await asyncio.sleep(0.2)
        assert handled == [b"member-ok"]
        assert endpoint.impostors == flood.impostor_messages
        legit.close(0)
    finally:
        flood.close()
        await endpoint.aclose()


@pytest.mark.timeout(120)
async def test_no_unauthenticated_message_reaches_the_registry_or_a_communicator():
    """The same flood at a forming group's registry and at every member's endpoint:
    nothing joins, nothing is listed, and the group's results stay exact."""
    async with open_local_cluster(2) as cluster:
        flood = _Flood(7)
        try:
            flood.open(cluster.registry.address, 30)
            for comm in cluster:
                flood.open(comm.address, 30)
            await asyncio.sleep(0.3)
            for _ in range(30):
                flood.send(100)
                await asyncio.sleep(0)
            status = cluster.registry.status()
            assert status["joining"] == []
            assert status["workers"] == []
            assert len(status["members"]) == 2

            async def exact(comm):
                x = np.full(8, comm.rank + 1.0)
                await comm.all_reduce(x)
                return x.tolist()

            assert await cluster.run(exact) == [[3.0] * 8] * 2
            await eventually(
                lambda: (
                    sum(c.statistics()["dropped"] for c in cluster)
                    + cluster.registry.dropped_messages
                    >= flood.impostor_messages
                ),
                "the impostors' messages, dropped and counted",
                20,
            )
        finally:
            flood.close()


# -- clear errors for the legitimate user ------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_process_with_another_jobs_secret_gets_a_clear_error_at_once(tmp_path):
    env = _env("the-registrys-secret-0123456789")
    registry, address = _start(["registry", "--address", "tcp://127.0.0.1:0"], env)
    try:
        code = (
            "import asyncio, dsml\n"
            f"asyncio.run(dsml.init({address!r}, world_size=2, rank=1).__aenter__())\n"
        )
        started = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=_env("a-different-secret-0123456789"),
            capture_output=True,
            text=True,
            timeout=50,
        )
        assert out.returncode != 0
        assert "another job's secret" in out.stderr, out.stderr
        assert "DSML_SECRET" in out.stderr
        assert time.monotonic() - started < 40  # not the join timeout
    finally:
        registry.terminate()
        registry.wait(timeout=10)


def test_a_secret_file_readable_by_others_is_refused(tmp_path):
    path = tmp_path / "secret"
    path.write_text("a-secret-of-enough-length-000\n")
    path.chmod(0o644)
    out = subprocess.run(
        [sys.executable, "-m", "dsml", "registry", "--secret-file", str(path)],
        env=_env(None),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert "readable by other users" in out.stderr
    assert "chmod 600" in out.stderr
