"""`dsml.Client`: run a function on worker daemons (daemon layer).

`await client.run(fn, *args, workers=k)` picks k idle daemons from the registry's list,
sends each the function as rank 0..k-1, and returns their results in rank order. Rank 0 is
asked first: it opens the job's registry and says where, then the others are sent the job
with that address. What the workers print arrives while the job runs and is printed here
with the rank in front. The first failure (a remote exception, a refused job, a worker
that disconnects) cancels the job on every other worker and raises; so does cancelling
`run` itself. Either way the workers end up idle.

A daemon that died while idle stays listed until the registry's heartbeat timeout. If one
is chosen, its address refuses the connection; since no rank calls `fn` before every rank
joined the job's group, nothing ran anywhere, so `run` chooses again without it (up to
`_ATTEMPTS` times) instead of failing. The same for a daemon that refuses the job as busy:
another client chose it from the same list, a moment earlier.

Choosing workers, submitting the job, waiting for it and cancelling it are here; the
records of workers and jobs are in client_jobs.py, the handling of what the workers send
back and of lost connections in client_replies.py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import secrets
from collections.abc import Callable
from types import TracebackType
from typing import Any

from .._opener import AsyncOnly
from ..config import CommConfig
from ..errors import (
    ConfigError,
    DsmlError,
    JobTimeoutError,
    RemoteError,
    WorkerLostError,
)
from ..membership import query_status
from ..transport import Channel, check_address
from ..wire import Kind
from .client_jobs import WorkerInfo, _Job
from .client_replies import _UNREACHABLE, ClientReplies
from .interrupt import interrupt_cancels
from .protocol import BUSY, MAX_JOB_FRAME, JobSpec, encode_job, envelope, job_config

__all__ = ["Client", "WorkerInfo"]

_CANCEL_WAIT_S = 5.0  # after a failure or a cancel, time the other ranks get to report
_ATTEMPTS = 3  # choices of workers per run, when chosen daemons turn out to be gone
_BUSY_RETRY_S = 0.2  # a daemon's beacon says at once when it takes a job


def _nothing_ran(exc: RemoteError) -> bool:
    """Whether the job failed before fn could run anywhere: a chosen daemon refused the
    connection, or refused the job because another client's job had just taken it."""
    if isinstance(exc, WorkerLostError):
        return exc.error_type == _UNREACHABLE
    return exc.error_type == "refused" and BUSY in str(exc)


class Client(AsyncOnly, ClientReplies):
    """Submits jobs to the worker daemons listed by the registry at `registry`.

    Args:
        registry: the cluster's registry address.
        curve_keys: folder made by `dsml keys generate`; needed when the cluster uses CURVE.
            This client's key (client.key) must be allowlisted on the workers.
        connect_timeout: how long a worker may take to accept a job before it is
            reported as unreachable.
    """

    _ASYNC_HINT = (
        "a Client closes asynchronously: use `async with dsml.Client(...) as client:` "
        "inside a coroutine (or `await client.aclose()` when done)"
    )

    def __init__(
        self,
        registry: str,
        curve_keys: str | os.PathLike[str] | None = None,
        *,
        connect_timeout: float = 10.0,
    ) -> None:
        self.registry = check_address(registry, "registry address")
        self.curve: Any = None
        if curve_keys is not None:
            from ..transport import Curve

            self.curve = Curve.load(curve_keys, role="client")
        self.connect_timeout = connect_timeout
        self.id = f"client-{secrets.token_hex(6)}"
        self._channels: dict[str, Channel] = {}
        self._jobs: dict[str, _Job] = {}
        self._finished: collections.deque[str] = collections.deque(maxlen=256)
        self._lost_ids: set[str] = set()
        self._unreachable_ids: set[str] = set()  # listed, but their address refused us
        self._closing: set[asyncio.Task[None]] = set()
        self._closed = False

    # -- workers ----------------------------------------------------------------------------

    async def workers(self) -> list[WorkerInfo]:
        """The worker daemons the registry lists, idle and busy, by name."""
        status = await query_status(
            self.registry, registry_timeout=self.connect_timeout, curve=self.curve
        )
        return [WorkerInfo.from_status(entry) for entry in status.get("workers", [])]

    def _choose(self, infos: list[WorkerInfo], wanted: int | None) -> list[WorkerInfo]:
        # A worker still listed busy with a job of ours that ended is idle by now (its next
        # hello says so), unless it was lost during that job.
        silent = [w for w in infos if w.silent or w.id in self._unreachable_ids]
        infos = [w for w in infos if w not in silent]
        idle = [
            w
            for w in infos
            if w.state == "idle" or (w.job in self._finished and w.id not in self._lost_ids)
        ]
        busy = len(infos) - len(idle)
        if not infos:
            raise DsmlError(
                f"no live workers are listed by the registry at {self.registry} "
                f"({len(silent)} silent for several heartbeats or gone): start some with "
                f"`dsml worker --registry {self.registry}` (or use dsml.LocalCluster)"
            )
        if wanted is None:
            if not idle:
                raise DsmlError(f"all {busy} workers are busy; try again when a job ended")
            return idle
        if len(idle) < wanted:
            raise DsmlError(
                f"asked for {wanted} workers, but only {len(idle)} of the {len(infos)} "
                f"listed are idle ({busy} busy)"
            )
        return idle[:wanted]

    # -- running ----------------------------------------------------------------------------

    async def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        workers: int | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - the public name (DESIGN.md)
        config: CommConfig | None = None,
    ) -> list[Any]:
        """Run `fn(comm, *args)` on `workers` idle workers (all idle ones when None).

        Returns the results in rank order. `fn` may be a coroutine function (awaited) or a
        plain one (called on the worker's event loop). Results must be plain data: None,
        bool, int, float, complex, str, bytes, lists, tuples, dicts, numpy arrays and
        scalars. `config` sets the job's communicator (collective `timeout`,
        `engine_trace`, `chunk_bytes`, ...); where it binds is the daemon's choice.

        Raises:
            RemoteError: `fn` raised on a worker (`rank`, `traceback`); the other workers'
                part of the job was cancelled.
            WorkerLostError: a worker died or disconnected during the job.
            JobTimeoutError: the job took longer than `timeout` seconds (it was cancelled).
            DsmlError: not enough idle workers, or a worker refused the job.
        """
        if self._closed:
            raise DsmlError("this client is closed")
        if not callable(fn):
            raise ConfigError(f"fn must be callable, got {type(fn).__name__}")
        if workers is not None and (type(workers) is not int or workers < 1):
            raise ConfigError(f"workers must be a positive integer or None, got {workers!r}")
        if timeout is not None and not timeout > 0:
            raise ConfigError(f"timeout must be positive seconds or None, got {timeout!r}")
        if config is not None and not isinstance(config, CommConfig):
            raise ConfigError(f"config must be a dsml.CommConfig, got {type(config).__name__}")
        try:
            frames = encode_job(fn, args)
        except Exception as exc:
            raise ConfigError(f"cannot send {fn!r} and its arguments: {exc}") from exc
        for frame in frames:
            if memoryview(frame).nbytes > MAX_JOB_FRAME:
                raise ConfigError(
                    f"an argument of {memoryview(frame).nbytes:,} bytes is over the "
                    f"{MAX_JOB_FRAME:,}-byte limit of one job frame: send it in parts, or "
                    "let the workers load it themselves"
                )
        label = getattr(fn, "__qualname__", repr(fn))
        loop = asyncio.get_running_loop()
        when = None if timeout is None else loop.time() + timeout
        attempt = 1
        with interrupt_cancels(asyncio.current_task()):  # Ctrl-C, or a notebook's interrupt
            while True:
                try:
                    async with asyncio.timeout_at(when) as deadline:
                        return await self._attempt(label, frames, workers, config)
                except TimeoutError:
                    if not deadline.expired():
                        raise
                    raise JobTimeoutError(
                        f"job {label} did not finish within {timeout:g} s; it was cancelled "
                        "on every worker"
                    ) from None
                except RemoteError as exc:
                    if not _nothing_ran(exc) or attempt >= _ATTEMPTS:
                        raise
                    attempt += 1  # nothing ran anywhere: choose again, without that daemon
                    if exc.error_type == "refused":  # let the registry hear it is busy
                        await asyncio.sleep(_BUSY_RETRY_S)

    async def _attempt(
        self, label: str, frames: list[Any], wanted: int | None, config: CommConfig | None
    ) -> list[Any]:
        """Choose workers and run the job on them once."""
        chosen = self._choose(await self.workers(), wanted)
        for worker in chosen:
            if worker.state == "busy":  # still on a job of ours that ended here (interrupted)
                self._channel(worker.address).send_nowait(
                    envelope(Kind.JOB_CANCEL, {"job": worker.job})
                )
        job = _Job(secrets.token_hex(6), chosen, label)
        job.config = job_config(config)
        self._jobs[job.id] = job
        try:
            return await self._drive(job, frames)
        except BaseException:
            await asyncio.shield(self._cancel(job))
            raise
        finally:
            self._jobs.pop(job.id, None)
            self._finished.append(job.id)

    async def _drive(self, job: _Job, frames: list[Any]) -> list[Any]:
        await self._submit(job, 0, frames, None)
        group = await self._wait_accepted(job, 0)
        if group is not None:
            for rank in range(1, len(job.workers)):
                await self._submit(job, rank, frames, group)
            for rank in range(1, len(job.workers)):
                await self._wait_accepted(job, rank)
        await asyncio.wait(job.results, return_when=asyncio.FIRST_EXCEPTION)
        if job.errors:
            await self._cancel(job)
            raise job.root_cause()
        return [future.result() for future in job.results]

    async def _submit(self, job: _Job, rank: int, frames: list[Any], group: str | None) -> None:
        worker = job.workers[rank]
        spec = JobSpec(job.id, rank, len(job.workers), group, job.config)
        channel = self._channel(worker.address)
        job.submitted.add(rank)
        try:
            async with asyncio.timeout(self.connect_timeout):
                await channel.send(envelope(Kind.JOB_SUBMIT, spec.to_wire()), frames)
        except (TimeoutError, DsmlError) as exc:
            why = "its queue stayed full" if isinstance(exc, TimeoutError) else str(exc)
            job.fail(
                rank,
                WorkerLostError(
                    f"could not send job {job.label} to worker {worker.name} at "
                    f"{worker.address}: {why}",
                    rank=rank,
                    worker=worker.name,
                    error_type="WorkerLost",
                ),
            )

    async def _wait_accepted(self, job: _Job, rank: int) -> str | None:
        worker = job.workers[rank]
        try:
            # Not asyncio.wait_for: on Python 3.11 it returns the result, dropping a cancel
            # that arrives as the acceptance does, and a cancelled run would go on.
            async with asyncio.timeout(self.connect_timeout):
                return await asyncio.shield(job.accepted[rank])
        except TimeoutError:
            job.fail(
                rank,
                WorkerLostError(
                    f"worker {worker.name} at {worker.address} did not accept job "
                    f"{job.label} within {self.connect_timeout:g} s: it may have died "
                    "(`dsml status` shows its last heartbeat) or, with CURVE, refused this "
                    "client's key",
                    rank=rank,
                    worker=worker.name,
                ),
            )
            return None

    async def _cancel(self, job: _Job) -> None:
        """Cancel the job where it still runs; wait a little for those ranks to report."""
        if job.cancelled:
            return
        job.cancelled = True
        # Also the ranks already failed here (lost, no answer): they may still run it.
        running = [r for r in sorted(job.submitted) if r not in job.reported]
        for rank in running:
            channel = self._channels.get(job.workers[rank].address)
            if channel is not None and not channel.closed:
                with contextlib.suppress(DsmlError):
                    channel.send_nowait(envelope(Kind.JOB_CANCEL, {"job": job.id}))
        for rank in range(len(job.workers)):
            if rank not in job.submitted and not job.results[rank].done():
                job.results[rank].cancel()  # never sent: nothing to wait for
        waiting = [job.results[r] for r in running if not job.results[r].done()]
        if waiting:
            await asyncio.wait(waiting, timeout=_CANCEL_WAIT_S)

    # -- closing ----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Cancel running jobs and close the connections to the workers."""
        if self._closed:
            return
        self._closed = True
        for job in list(self._jobs.values()):
            job.closed = DsmlError(
                f"the client was closed while job {job.label} ran; it was cancelled on every worker"
            )
            await self._cancel(job)
            for rank in range(len(job.workers)):  # nothing can answer once channels close
                job.fail(rank, RemoteError("the client was closed", rank=rank))
        for channel in self._channels.values():
            await channel.aclose(linger_s=0.5)
        self._channels.clear()
        if self._closing:
            await asyncio.wait(self._closing)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._jobs)} running"
        curve = " curve" if self.curve is not None else ""
        return f"<Client registry={self.registry}{curve} jobs {state}>"
