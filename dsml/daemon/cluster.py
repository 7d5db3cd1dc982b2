"""`dsml.LocalCluster`: a registry and n worker daemons on this machine (daemon layer).

For notebooks and tests: `async with dsml.LocalCluster(4) as cluster:` starts
`dsml registry` and four `dsml worker` processes on loopback, waits until the registry lists
every worker as idle, and hands out clients with `cluster.client()`. On exit, on any error,
and at interpreter exit, every process it started is stopped (SIGTERM, then SIGKILL after a
grace period); on Linux they also get SIGKILL if this process dies. It stops only the
processes it started, by PID.

Workers start in this process's current directory with that directory first on their
`sys.path`, so a notebook's neighbouring modules import on the workers too.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import sys
import time
import weakref
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from .._opener import AsyncOnly
from .._process import describe_exit, die_with_parent
from ..collectives.devices import parse_device
from ..errors import ConfigError, DsmlError
from .client import Client

__all__ = ["LocalCluster", "WorkerProcess"]

_TAIL_LINES = 30
_STOP_GRACE_S = 5.0


@dataclass
class WorkerProcess:
    """One `dsml worker` process of a LocalCluster."""

    name: str
    pid: int
    address: str = ""
    process: asyncio.subprocess.Process | None = field(default=None, repr=False)
    tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=_TAIL_LINES), repr=False
    )

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None


class LocalCluster(AsyncOnly):
    """A registry and `n_workers` worker daemons as local processes (see module docstring).

    Args:
        n_workers: how many `dsml worker` processes to start.
        device: "cpu" (default), "cuda" (worker i gets GPU i % count) or "cuda:N".
        heartbeat_interval: seconds between heartbeats (the registry's setting).
        heartbeat_timeout: a worker silent this long is declared dead (the registry's).
        startup_timeout: seconds to wait for every process to be up and listed.
        env: extra environment variables for the processes.
        threads_per_worker: OMP_NUM_THREADS of each worker (unless `env` sets it).
    """

    _ASYNC_HINT = (
        "a LocalCluster starts and stops asynchronously: use `async with "
        "dsml.LocalCluster(n) as cluster:` inside a coroutine"
    )

    def __init__(
        self,
        n_workers: int = 4,
        *,
        device: str = "cpu",
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 10.0,
        startup_timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
        threads_per_worker: int = 1,
    ) -> None:
        if type(n_workers) is not int or n_workers < 1:
            raise ConfigError(f"n_workers must be a positive integer, got {n_workers!r}")
        self.n_workers = n_workers
        self.device = str(parse_device(device))  # cupy and the GPUs: each worker checks
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.startup_timeout = startup_timeout
        self.address = ""
        self.workers: list[WorkerProcess] = []
        self._registry: WorkerProcess | None = None
        self._clients: list[Client] = []
        self._pumps: set[asyncio.Task[None]] = set()
        self._env = _worker_env(env, threads_per_worker)
        self._cwd = os.getcwd()
        self._state = "new"
        self._processes: list[asyncio.subprocess.Process] = []  # every one started
        self._finalizer = weakref.finalize(self, _kill_all, self._processes)

    # -- opening ----------------------------------------------------------------------------

    def __await__(self) -> Generator[Any, None, LocalCluster]:
        return self.start().__await__()

    async def __aenter__(self) -> LocalCluster:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def start(self) -> LocalCluster:
        """Start the registry and the workers; wait until every worker is listed idle."""
        if self._state != "new":
            raise DsmlError(f"this LocalCluster is {self._state}; make a new one")
        self._state = "starting"
        try:
            async with asyncio.timeout(self.startup_timeout):
                await self._start_registry()
                names = [f"worker-{i}" for i in range(self.n_workers)]
                await asyncio.gather(*(self._start_worker(name) for name in names))
                await self._wait_listed(self.workers)
        except BaseException as exc:
            await self.aclose()
            if isinstance(exc, TimeoutError):
                raise DsmlError(
                    f"the local cluster did not start within {self.startup_timeout:g} s"
                    f"{self._tails()}"
                ) from None
            raise
        self._state = "running"
        return self

    async def _start_registry(self) -> None:
        argv = [
            "registry",
            "--address",
            "tcp://127.0.0.1:0",
            "--heartbeat-interval",
            str(self.heartbeat_interval),
            "--heartbeat-timeout",
            str(self.heartbeat_timeout),
        ]
        self._registry = await self._spawn("registry", argv, self._env)
        line = await self._first_line(self._registry)
        self.address = line.rsplit(" ", 1)[-1]

    async def add_worker(self) -> WorkerProcess:
        """Start one more worker and wait until the registry lists it."""
        worker = await self._start_worker(f"worker-{len(self.workers)}")
        await self._wait_listed([worker])
        return worker

    async def _start_worker(self, name: str) -> WorkerProcess:
        env = dict(self._env, LOCAL_RANK=name.rsplit("-", 1)[-1])
        argv = ["worker", "--registry", self.address, "--name", name, "--device", self.device]
        argv += ["--heartbeat-interval", str(self.heartbeat_interval)]
        worker = await self._spawn(name, argv, env)
        self.workers.append(worker)
        line = await self._first_line(worker)
        worker.address = line.split(" serving on ", 1)[-1].split()[0]
        return worker

    async def _spawn(self, name: str, argv: Sequence[str], env: Mapping[str, str]) -> WorkerProcess:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "dsml",
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=dict(env),
            cwd=self._cwd,
            start_new_session=True,  # a terminal's Ctrl-C reaches this process only
            preexec_fn=die_with_parent,
        )
        self._processes.append(process)
        return WorkerProcess(name, process.pid, process=process)

    async def _first_line(self, proc: WorkerProcess) -> str:
        """The process's startup line; afterwards its output is only kept as a tail."""
        assert proc.process is not None
        assert proc.process.stdout is not None
        line = (await proc.process.stdout.readline()).decode(errors="replace").strip()
        if not line:
            code = await proc.process.wait()
            assert proc.process.stderr is not None
            err = (await proc.process.stderr.read()).decode(errors="replace").strip()
            raise DsmlError(f"{proc.name} exited at startup ({describe_exit(code)}): {err[-2000:]}")
        for stream in (proc.process.stdout, proc.process.stderr):
            assert stream is not None
            task = asyncio.get_running_loop().create_task(_pump(stream, proc.tail))
            self._pumps.add(task)
            task.add_done_callback(self._pumps.discard)
        return line

    async def _wait_listed(self, workers: list[WorkerProcess]) -> None:
        names = {w.name for w in workers}
        probe = Client(self.address)
        while True:
            listed = {w.name for w in await probe.workers() if w.state == "idle"}
            if names <= listed:
                return
            for worker in workers:
                if not worker.running:
                    assert worker.process is not None
                    code = worker.process.returncode or 0
                    raise DsmlError(
                        f"{worker.name} exited at startup ({describe_exit(code)}){self._tails()}"
                    )
            await asyncio.sleep(0.05)

    def _tails(self) -> str:
        parts = []
        for proc in [self._registry, *self.workers]:
            if proc is not None and proc.tail:
                parts.append(f"\n---- {proc.name} ----\n" + "\n".join(proc.tail))
        return "".join(parts)

    # -- using ------------------------------------------------------------------------------

    def client(self) -> Client:
        """A `dsml.Client` of this cluster (closed with the cluster)."""
        if self._state == "new":
            raise DsmlError(
                "this LocalCluster is not started: use `async with dsml.LocalCluster(n) as "
                "cluster:` (or `await cluster.start()`) inside a coroutine first"
            )
        if self._state != "running":
            raise DsmlError(f"this LocalCluster is {self._state}")
        client = Client(self.address)
        self._clients.append(client)
        return client

    # -- closing ----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stop every process this cluster started (SIGTERM, then SIGKILL) and wait for them."""
        if self._state == "closed":
            return
        self._state = "closed"
        for client in self._clients:
            with contextlib.suppress(Exception):
                await client.aclose()
        workers = [w for w in self.workers if w.process is not None]
        await _stop([w.process for w in workers if w.process is not None])
        if self._registry is not None and self._registry.process is not None:
            await _stop([self._registry.process])
        pumps = list(self._pumps)
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        self._finalizer.detach()

    def __repr__(self) -> str:
        workers = ", ".join(
            f"{w.name} (pid {w.pid}, {w.address or 'starting'}{'' if w.running else ', exited'})"
            for w in self.workers
        )
        return f"<LocalCluster {self._state} registry={self.address or '-'} workers=[{workers}]>"


def _worker_env(extra: Mapping[str, str] | None, threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    cwd = os.getcwd()
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = cwd + (os.pathsep + path if path else "")
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env["PYTHONUNBUFFERED"] = "1"
    return env


async def _pump(stream: asyncio.StreamReader, tail: collections.deque[str]) -> None:
    """Keep the last lines of a child's output; read in chunks, so no line is too long."""
    rest = b""
    with contextlib.suppress(Exception):
        while chunk := await stream.read(1 << 16):
            *lines, rest = (rest + chunk).split(b"\n")
            tail.extend(line.decode(errors="replace")[:1000] for line in lines)
            rest = rest[-4096:]


async def _stop(processes: list[asyncio.subprocess.Process]) -> None:
    running = [p for p in processes if p.returncode is None]
    for process in running:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _STOP_GRACE_S
    for process in running:
        try:
            await asyncio.wait_for(process.wait(), max(0.01, deadline - time.monotonic()))
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()


def _kill_all(processes: list[asyncio.subprocess.Process]) -> None:
    """Last resort at interpreter exit or garbage collection: SIGKILL what still runs."""
    for process in processes:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError, OSError):
                os.kill(process.pid, signal.SIGKILL)
