"""A throw-away Slurm cluster on namespaced hosts (tests only).

`open_slurm(hosts)` starts, on hosts made by `dsml.testing.netns` (the first one is the
controller and login node, the others compute nodes):

- munged, as the munge user, with a fresh key and its socket in a temporary directory;
- slurmctld on the controller; one slurmd per compute node, each inside its host's
  network, UTS (host name) and mount (/etc/hosts) namespaces, entered with `nsenter`
  (`ip netns exec` would remount /sys, where slurmd looks for cgroups);
- a slurm.conf for all of them in the same directory (`SLURM_CONF`), with each node
  declaring `cpus` CPUs whatever the machine has (`SlurmdParameters=config_overrides`),
  and the plugins that need no systemd or cgroup setup (`proctrack/linuxproc`,
  `task/none`).

`srun(...)` runs on the controller host. Every daemon is stopped by its PID on close, and
the directory removed. Ports are Slurm's defaults: they live inside the namespaces, so
concurrent runs never meet. `unavailable_reason()` says why it cannot run here (packages
missing: `.ci/run` installs them where it may).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from dsml.testing.netns import Host, NetnsHosts

__all__ = ["SlurmCluster", "open_slurm", "unavailable_reason"]

PACKAGES = "slurmctld slurmd slurm-client munge"
_BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sinfo")


def unavailable_reason() -> str | None:
    """Why a Slurm cluster cannot be started here, or None when it can."""
    missing = [b for b in _BINARIES if shutil.which(b) is None]
    if missing:
        return (
            f"Slurm not installed ({', '.join(missing)} not on PATH): as root, "
            f"`apt-get install --no-install-recommends {PACKAGES}` (.ci/run does)"
        )
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "no `munge` user (the munge package creates it): munged refuses to run as root"
    return None


def _conf(directory: Path, controller: Host, nodes: Sequence[Host], cpus: int) -> str:
    d = directory
    lines = [
        "ClusterName=dsmltest",
        f"SlurmctldHost={controller.name}({controller.address})",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={d}/munge/munge.socket",
        f"StateSaveLocation={d}/state",
        f"SlurmdSpoolDir={d}/spool-%n",
        f"SlurmctldPidFile={d}/slurmctld.pid",
        f"SlurmdPidFile={d}/slurmd-%n.pid",
        f"SlurmctldLogFile={d}/slurmctld.log",
        f"SlurmdLogFile={d}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "SlurmdParameters=config_overrides",
        "SchedulerType=sched/builtin",
        "SchedulerParameters=batch_sched_delay=0",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "ReturnToService=2",
        "JobCompType=jobcomp/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=30",
        "InactiveLimit=0",
        "KillWait=1",
    ]
    for node in nodes:
        lines.append(f"NodeName={node.name} NodeAddr={node.address} CPUs={cpus} State=UNKNOWN")
    names = ",".join(n.name for n in nodes)
    lines.append(f"PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


class SlurmCluster:
    """munged, slurmctld and slurmds on namespaced hosts; `srun` from the controller."""

    def __init__(self, hosts: NetnsHosts, *, cpus: int = 4) -> None:
        self.controller = hosts[0]
        self.nodes = list(hosts)[1:]
        self.cpus = cpus
        self.dir = Path(tempfile.mkdtemp(prefix=f"dsml-slurm-{os.getpid()}-"))
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge" / "munge.socket"  # in a dir munge owns
        self._daemons: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.started_s = 0.0  # seconds from start() until every node was idle

    def __repr__(self) -> str:
        daemons = ", ".join(f"{name}={p.pid}" for name, p in self._daemons)
        return f"SlurmCluster({self.dir}, {daemons})"

    @property
    def env(self) -> dict[str, str]:
        """Variables Slurm's commands need to find this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def start(self, timeout: float = 30.0) -> None:
        """Start every daemon and wait until every node is idle."""
        began = time.monotonic()
        os.chmod(self.dir, 0o755)
        self.conf.write_text(_conf(self.dir, self.controller, self.nodes, self.cpus))
        (self.dir / "state").mkdir()
        for node in self.nodes:
            (self.dir / f"spool-{node.name}").mkdir()
        self._start_munge()
        self._spawn("slurmctld", self.controller, ["slurmctld", "-D", "-c", "-f", str(self.conf)])
        for node in self.nodes:
            self._spawn(f"slurmd {node.name}", node, ["slurmd", "-D", "-N", node.name])
        self._wait_idle(timeout)
        self.started_s = time.monotonic() - began

    def _start_munge(self) -> None:
        munge = self.dir / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        user = pwd.getpwnam("munge")
        for path in (munge, key):
            os.chown(path, user.pw_uid, user.pw_gid)
        argv = [
            "munged",
            "--foreground",
            "--force",  # the temp dir's parent (/tmp) is world-writable, as munged notes
            f"--key-file={key}",
            f"--socket={self.munge_socket}",
            f"--pid-file={munge}/munged.pid",
            f"--log-file={munge}/munged.log",
            f"--seed-file={munge}/munged.seed",
        ]
        self._spawn_plain("munged", argv, user=user.pw_uid, group=user.pw_gid)
        deadline = time.monotonic() + 10.0
        while not self.munge_socket.exists():
            self._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged made no socket in 10 s\n{self.logs()}")
            time.sleep(0.01)

    def _spawn_plain(self, name: str, argv: list[str], **kwargs: Any) -> None:
        log = open(self.dir / f"{name.replace(' ', '-')}.out", "wb")  # noqa: SIM115
        with log:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **kwargs
            )
        self._daemons.append((name, proc))

    def _spawn(self, name: str, host: Host, argv: list[str]) -> None:
        env = {**os.environ, **self.env}
        self._spawn_plain(name, host.command(argv), env=env)

    def _check_alive(self) -> None:
        for name, proc in self._daemons:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}\n{self.logs()}")

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            self._check_alive()
            out = self.controller.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"], env={**os.environ, **self.env}, check=False
            )
            states = out.stdout + out.stderr
            idle = {line.split()[0] for line in out.stdout.splitlines() if "idle" in line}
            if idle >= {n.name for n in self.nodes}:
                return
            time.sleep(0.05)
        raise RuntimeError(f"nodes not idle within {timeout} s: {states}\n{self.logs()}")

    def srun(
        self, args: Sequence[str], env: dict[str, str], **kwargs: Any
    ) -> subprocess.Popen[Any]:
        """Start `srun ARGS...` on the controller host with `env` plus SLURM_CONF."""
        return self.controller.popen(["srun", *args], env={**env, **self.env}, **kwargs)

    def logs(self) -> str:
        """Every daemon's log files, for a failure message."""
        parts = []
        for path in sorted(self.dir.rglob("*")):
            if path.is_file() and path.suffix in (".log", ".out"):
                text = path.read_text(errors="replace")[-3000:]
                parts.append(f"--- {path.name}:\n{text}")
        return "\n".join(parts)

    def close(self) -> None:
        """Kill every daemon by PID (its process group); remove the directory.

        SIGKILL at once: the cluster and its state are thrown away, and a slurmd asked
        to stop politely may wait seconds for its steps. Step daemons (slurmstepd) leave
        slurmd's group: `NetnsHosts.close()` kills whatever is left in the namespaces.
        """
        for _, proc in reversed(self._daemons):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for _, proc in self._daemons:
            proc.wait(timeout=10.0)
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def open_slurm(hosts: NetnsHosts, *, cpus: int = 4) -> Iterator[SlurmCluster]:
    """A started Slurm cluster on `hosts` (controller first), stopped on exit."""
    cluster = SlurmCluster(hosts, cpus=cpus)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()
