"""pytest side of the namespaced multi-host harness (`dsml.testing.netns`).

`hosts` (a fixture, registered by tests/multihost/conftest.py) gives four hosts `h0`..`h3`
on one bridge, links shaped to 1 Gbit/s; it skips with the exact reason where namespaces
cannot be made (not root, iproute2 or util-linux missing, no permission to create a
namespace), and its finalizer removes everything and checks that no namespace of this
process is left (`ip netns list`).

`Procs` runs JSON-line-printing commands on hosts and collects their events.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from dsml.testing.netns import Host, NetnsError, NetnsHosts, leftover_namespaces, unavailable_reason

ROOT = Path(__file__).resolve().parents[2]
Event = dict[str, Any]
# What `ip`/`tc` say when the kernel or the container lacks a capability (no
# CAP_SYS_ADMIN/CAP_NET_ADMIN, no veth/bridge/tbf module): a reason to skip, not a bug.
_MISSING_CAPABILITY = (
    "Operation not permitted",
    "Permission denied",
    "not supported",
    "Unknown device type",
    "qdisc kind is unknown",
)


def open_hosts(
    n_hosts: int = 4, *, rate: str | None = "1gbit", names: Sequence[str] = (), family: int = 4
):
    """Open namespaced hosts, or skip the test with the reason they cannot be made here."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    hosts = NetnsHosts(n_hosts, rate=rate, names=names, family=family)
    try:
        hosts.open()
    except NetnsError as exc:
        if any(sign in str(exc) for sign in _MISSING_CAPABILITY):
            pytest.skip(f"this machine cannot build namespaced hosts: {exc}")
        raise
    return hosts


def close_hosts(hosts: NetnsHosts) -> None:
    """Remove the hosts; fail if a namespace of this process is still listed."""
    hosts.close()
    left = set(leftover_namespaces(os.getpid())) & set(hosts.namespaces)
    assert not left, f"namespaces left behind: {sorted(left)}"


def hosts_fixture(family: int = 4) -> Iterator[NetnsHosts]:
    hosts = open_hosts(4, family=family)
    try:
        yield hosts
    finally:
        close_hosts(hosts)


def dsml_run_argv(
    nprocs: int, nnodes: int, node_rank: int, registry: str, script: Sequence[str]
) -> list[str]:
    """`dsml run` of `script` as node `node_rank` of `nnodes`, `nprocs` ranks on it."""
    return [
        PYTHON,
        "-m",
        "dsml",
        "run",
        "-n",
        str(nprocs),
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--registry",
        registry,
        *script,
    ]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without any DSML_* or launcher variable, plus `extra`."""
    launcher = ("DSML_", "MASTER_", "SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_")
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher) and k not in names}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


class Proc:
    """A command on one host whose stdout lines (JSON events) a thread collects."""

    def __init__(self, host: Host, proc: subprocess.Popen[str], cond: threading.Condition):
        self.host = host
        self.proc = proc
        self.events: list[Event] = []
        self.lines: list[str] = []
        self._cond = cond
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line)
                start = line.find("{")  # after a "[rank N] " prefix, under dsml run
                if start >= 0:
                    with contextlib.suppress(ValueError):
                        self.events.append(json.loads(line[start:]))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.get("event") == kind]

    def output(self) -> str:
        return "".join(self.lines)


class Procs:
    """Commands started on hosts; waits on their events; shows all output on failure."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.procs: list[Proc] = []

    def start(self, host: Host, argv: Sequence[str], env: dict[str, str]) -> Proc:
        popen = host.popen(
            argv,
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        proc = Proc(host, popen, self.cond)
        self.procs.append(proc)
        return proc

    def wait_until(self, done: Callable[[], bool], what: str, timeout: float = 40.0) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out waiting for {what}\n{self.report()}")
                self.cond.wait(min(left, 0.5))

    def wait_exit(self, timeout: float = 40.0) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"a process did not exit\n{self.report()}") from None
            proc._thread.join(5.0)
        return codes

    def report(self) -> str:
        return "\n".join(
            f"--- {p.host.name} pid {p.proc.pid} rc {p.proc.poll()}:\n{p.output()}"
            for p in self.procs
        )


PYTHON = sys.executable
