"""The worker daemon behind `dsml worker` (daemon layer).

A daemon binds one job endpoint, tells the registry every heartbeat interval that it is
there and whether it is busy, and runs one job at a time. A job is `fn(comm, *args)` sent
by a `dsml.Client` to k daemons as ranks 0..k-1: rank 0 opens a registry of the job's own
(so the job's group is exactly its workers, and the cluster's registry never carries a
job's membership), the others join it, and each builds a communicator with `dsml.init`.
What the job prints goes to the client line by line; its result, or its error with the
traceback, goes back when it ends. A failing job never takes the daemon down; after every
job the daemon is idle again.

The daemon itself (its endpoint, its hellos to the registry, the messages of clients,
running a job) is here; the record of a job and how it ends are in worker_jobs.py, the
forwarding of what a job prints in worker_output.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import os
import secrets
import socket
from collections.abc import Sequence
from typing import Any

from ..collectives.devices import parse_device, resolve_device
from ..communicator import init
from ..config import CommConfig, RegistryConfig
from ..errors import ConfigError, ProtocolError
from ..membership import open_registry
from ..membership.registry import Registry
from ..transport import Beacon, Channel, Endpoint, check_address, is_loopback
from ..transport.addresses import advertised, format_tcp, host_of
from ..wire import Envelope, Fields, Kind
from ..wire.values import pack_value
from .protocol import (
    BUSY,
    MAX_JOB_FRAME,
    JobSpec,
    apply_job_config,
    decode_job,
    envelope,
)
from .worker_jobs import (
    _LEAVE_WAIT_S,
    _check_sizes,
    _close_fully,
    _close_job_registry,
    _failure,
    _failure_of,
    _Job,
)
from .worker_output import _forwarding

__all__ = ["WorkerConfig", "WorkerDaemon"]

log = logging.getLogger("dsml.worker")

_CANCEL_WAIT_S = 5.0  # on shutdown, time a cancelled job gets to end


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Settings of one worker daemon.

    Attributes:
        registry: the cluster's registry, where the daemon is listed.
        name: shown by `dsml status` and `client.workers()` (default: host-pid).
        device: "cpu" or "cuda:N", passed to `dsml.init` for each job.
        bind: the job endpoint's address; a job's registry and peer links bind the same
            host. Anything but loopback needs `curve`.
        curve: CURVE keys (`dsml.transport.Curve`, role "server"): clients must be
            allowlisted, and every socket of the daemon and its jobs is encrypted.
        heartbeat_interval: seconds between the daemon's hellos to the registry.
        comm: settings of the jobs' communicators (`bind` is derived from `bind`).
    """

    registry: str
    name: str = ""
    device: str = "cpu"
    bind: str = "tcp://127.0.0.1:0"
    curve: Any = None
    heartbeat_interval: float = 1.0
    comm: CommConfig = dataclasses.field(default_factory=CommConfig)

    def __post_init__(self) -> None:
        check_address(self.registry, "registry address")
        check_address(self.bind, "bind address")
        if self.curve is None and not is_loopback(self.bind):
            raise ConfigError(
                f"refusing to serve on {self.bind} without CURVE: a worker runs the functions "
                "clients send it, so anyone who can reach that address could run code as "
                "this user. Create keys with `dsml keys generate DIR` and pass --curve-keys "
                "DIR (WorkerConfig(curve=Curve.load(DIR))), or bind a loopback address."
            )
        if self.heartbeat_interval <= 0:
            raise ConfigError("heartbeat_interval must be positive")
        # Here, once, rather than in every job it would run: cupy installed, a GPU visible.
        resolve_device(parse_device(self.device), 0)


class WorkerDaemon:
    """One worker daemon; `await WorkerDaemon(config).start()`, then `aclose()`."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.id = secrets.token_hex(8)
        self.name = config.name or f"{socket.gethostname()}-{os.getpid()}"
        self.jobs_done = 0
        self._endpoint: Endpoint | None = None
        self._address = ""
        self._beacon: Beacon | None = None
        self._job: _Job | None = None
        self._next: _Job | None = None  # submitted while the previous job is cancelling
        self._closing = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._host = _host_of(config.bind)
        self._closing_registries: set[asyncio.Task[None]] = set()

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> WorkerDaemon:
        self._endpoint = Endpoint.bind(
            self.config.bind,
            self._on_message,
            max_frame_bytes=MAX_JOB_FRAME,
            name="worker",
            curve=self.config.curve,
        )
        # resolved once, not per hello
        self._address = advertised(self._endpoint.address, toward=self.config.registry)
        self._beacon = Beacon(
            self.config.registry,
            f"worker-{self.id}".encode(),
            self.config.heartbeat_interval,
            self._hello,
            curve=self.config.curve,
        )
        log.info("worker %s serving on %s", self.name, self.address)
        return self

    @property
    def address(self) -> str:
        assert self._address, "the daemon is not started"
        return self._address

    @property
    def busy(self) -> bool:
        return self._job is not None

    async def aclose(self) -> None:
        """Cancel a running job (the client hears so), deregister, close every socket."""
        if self._closing:
            return
        self._closing = True
        self._next = None
        job = self._job
        if job is not None and job.task is not None:
            job.cancelled = True
            job.task.cancel()
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancel that
            # arrives as the job ends.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_CANCEL_WAIT_S):
                    await asyncio.shield(self._idle.wait())
        if self._closing_registries:
            await asyncio.wait(self._closing_registries, timeout=_LEAVE_WAIT_S + 1)
        if self._beacon is not None:
            self._beacon.stop()  # no hello may follow the goodbye
        await self._say_goodbye()
        if self._endpoint is not None:
            await self._endpoint.aclose()

    async def _say_goodbye(self) -> None:
        with contextlib.suppress(Exception):
            channel = Channel.connect(
                self.config.registry, f"worker-{self.id}.bye".encode(), curve=self.config.curve
            )
            await channel.send(envelope(Kind.WORKER_BYE, {"id": self.id}))
            await channel.aclose(linger_s=1.0)

    def _hello(self) -> Envelope:
        job = self._job
        return envelope(
            Kind.WORKER_HELLO,
            {
                "id": self.id,
                "name": self.name,
                "address": self.address,
                "device": self.config.device,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "state": "busy" if job is not None else "idle",
                "job": job.spec.job if job is not None else "",
                "jobs_done": self.jobs_done,
                "interval": self.config.heartbeat_interval,
            },
        )

    # -- messages ---------------------------------------------------------------------------

    def _on_message(self, sender: bytes, env: Envelope, payload: list[memoryview]) -> None:
        if env.kind is Kind.JOB_SUBMIT:
            self._on_submit(sender, env, payload)
        elif env.kind is Kind.JOB_CANCEL:
            job_id = Fields(env.body, "JobCancel").get_str("job", 64)
            self._on_cancel(sender, job_id)
        else:
            raise ProtocolError(f"a worker does not accept {env.kind.name}")

    def _on_submit(self, sender: bytes, env: Envelope, payload: list[memoryview]) -> None:
        try:
            spec = JobSpec.from_wire(env.body)
            if not payload:
                raise ProtocolError("JobSubmit carries the pickled function as its first frame")
        except ProtocolError as exc:  # tell the client why, when it said which job this is
            body = env.body if isinstance(env.body, dict) else {}
            job_id, rank = body.get("job"), body.get("rank")
            if isinstance(job_id, str) and len(job_id) <= 64 and type(rank) is int:
                bad = _Job(JobSpec(job_id, rank, rank + 1, None), sender, [])
                self._refuse(bad, f"malformed submission: {exc}")
            raise
        job = _Job(spec, sender, payload)
        current = self._job
        if self._closing:
            self._refuse(job, "the worker is shutting down")
        elif current is None:
            self._start(job)
        elif current.cancelled and current.client == sender and self._next is None:
            self._next = job  # the client's previous job is still winding down
        else:
            self._refuse(job, f"{BUSY} {current.spec.job}")

    def _refuse(self, job: _Job, reason: str) -> None:
        log.warning("refused job %s: %s", job.spec.job, reason)
        self._send(job, Kind.JOB_REFUSED, {"reason": reason})

    def _on_cancel(self, sender: bytes, job_id: str) -> None:
        job, queued = self._job, self._next
        if job is not None and job.spec.job == job_id and job.client == sender:
            self._cancel_job(job, "cancelled by its client")
        elif queued is not None and queued.spec.job == job_id and queued.client == sender:
            self._next = None
            self._send(queued, Kind.JOB_RESULT, _failure("CancelledError", "cancelled"))

    def _cancel_job(self, job: _Job, why: str) -> None:
        if not job.cancelled and job.task is not None:
            log.info("job %s %s", job.spec.job, why)
            job.cancelled = True
            job.task.cancel()

    def _start(self, job: _Job) -> None:
        self._job = job
        self._idle.clear()
        job.task = asyncio.get_running_loop().create_task(self._run(job))
        # Not in _run's `finally`: a task cancelled before its first step never runs it.
        job.task.add_done_callback(lambda _: self._ended(job))
        if self._beacon is not None:
            self._beacon.beat_now()

    def _ended(self, job: _Job) -> None:
        if not job.reported:  # cancelled before it started
            self._send(job, Kind.JOB_RESULT, _failure("CancelledError", "the job was cancelled"))
        self._finish(job)

    def _finish(self, job: _Job) -> None:
        self._job = None
        self.jobs_done += 1
        following, self._next = self._next, None
        if following is not None and not self._closing:
            self._start(following)
            return
        self._idle.set()
        if self._beacon is not None:
            self._beacon.beat_now()

    def _send(
        self, job: _Job, kind: Kind, body: dict[str, Any], frames: Sequence[Any] = ()
    ) -> None:
        if kind is Kind.JOB_RESULT:
            job.reported = True
        if job.client_gone:
            return
        body = {"job": job.spec.job, "rank": job.spec.rank} | body
        if self._endpoint is not None and self._endpoint.send_nowait(
            job.client, envelope(kind, body), frames
        ):
            return
        # Gone (or not reading): nobody waits for this job any more. No print here: while
        # a job runs, sys.stderr is the job's output, which is what just failed.
        job.client_gone = True
        log.warning("the client of job %s is gone; cancelling the job", job.spec.job)
        if job is self._job:
            self._cancel_job(job, "lost its client")

    # -- running a job ----------------------------------------------------------------------

    async def _run(self, job: _Job) -> None:
        registry: Registry | None = None
        try:
            try:
                fn, args = decode_job(job.frames)
                job.frames = []
                group = job.spec.group
                if job.spec.rank == 0:
                    registry = await open_registry(
                        config=RegistryConfig(
                            address=format_tcp(self._host, 0), curve=self.config.curve
                        )
                    )
                    group = advertised(registry.address, toward=self.config.registry)
                assert group is not None
                self._send(job, Kind.JOB_ACCEPTED, {"group": group})
                keepalive = asyncio.get_running_loop().create_task(self._keep_telling(job, group))
                try:
                    with _forwarding(self, job):
                        result = await self._call(job, group, fn, args)
                finally:
                    keepalive.cancel()
                header, frames = pack_value(result)
                _check_sizes(frames, MAX_JOB_FRAME)
            except asyncio.CancelledError:
                if job.failure is not None:  # fn had failed; the cancel cut its cleanup short
                    self._send(job, Kind.JOB_RESULT, _failure_of(job.failure))
                else:
                    why = (
                        "the worker is shutting down" if self._closing else "the job was cancelled"
                    )
                    self._send(job, Kind.JOB_RESULT, _failure("CancelledError", why))
            except BaseException as exc:  # SystemExit and KeyboardInterrupt fail the job only
                self._send(job, Kind.JOB_RESULT, _failure_of(exc))
            else:
                self._send(job, Kind.JOB_RESULT, {"ok": True}, [header, *frames])
        finally:
            if registry is not None:  # closes once the others left; the next job need not wait
                task = asyncio.get_running_loop().create_task(_close_job_registry(registry))
                self._closing_registries.add(task)
                task.add_done_callback(self._closing_registries.discard)

    async def _keep_telling(self, job: _Job, group: str) -> None:
        """Repeat JOB_ACCEPTED every heartbeat interval while the job runs (the client
        ignores a repeat): a send that fails is how the daemon learns that its client is
        gone, and a job that prints nothing would otherwise never send, keeping this
        daemon busy with a dead client's job for good."""
        while not job.client_gone:
            await asyncio.sleep(self.config.heartbeat_interval)
            self._send(job, Kind.JOB_ACCEPTED, {"group": group})

    async def _call(self, job: _Job, group: str, fn: Any, args: tuple[Any, ...]) -> Any:
        comm_config = dataclasses.replace(
            apply_job_config(self.config.comm, job.spec.config),
            bind=format_tcp(self._host, 0),
            curve=self.config.curve,
        )
        comm = await init(
            group,
            job.spec.world_size,
            rank=job.spec.rank,
            name=self.name,
            device=self.config.device,
            config=comm_config,
        )
        try:
            result = fn(comm, *args)
            if inspect.isawaitable(result):
                result = await result
        except BaseException as exc:
            # Leaving the group (telling the peers) takes a moment, in which the client,
            # told of the failure by a peer, may cancel this job: report `exc` anyway,
            # the root cause, not the cancellation of its cleanup.
            if not isinstance(exc, asyncio.CancelledError):
                job.failure = exc
            error = exc if isinstance(exc, Exception) else None
            await _close_fully(comm, error=error, cancel=True)
            raise
        await _close_fully(comm, error=None, cancel=False)
        return result

    def __repr__(self) -> str:
        state = f"busy with {self._job.spec.job}" if self._job else "idle"
        address = self._endpoint.address if self._endpoint else "unbound"
        return f"<WorkerDaemon {self.name} {address} {state} jobs_done={self.jobs_done}>"


def _host_of(bind: str) -> str:
    if bind.startswith("tcp://"):
        return host_of(bind)
    return "127.0.0.1"  # an ipc:// daemon runs its jobs over loopback
