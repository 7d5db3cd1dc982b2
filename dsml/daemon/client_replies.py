"""What comes back from the workers, and how failures land on a job (daemon layer).

`ClientReplies` keeps the client's connection to each worker and handles what arrives
on it: a worker's acceptance, the lines the job prints (shown with the rank in front, in
the caller's context), its result or its error, a refusal. A connection's failures fail
the ranks that worker runs: an address that refuses the connection (a daemon that died
while idle), a disconnection during a job, a CURVE key refused. Each lands on the job's
record (`_Job.fail`, client_jobs.py), where `Client.run` waits (client.py).
"""

from __future__ import annotations

import asyncio
import functools
import sys
from typing import Any

from ..errors import ProtocolError, RemoteError, WorkerLostError
from ..transport import Channel
from ..wire import Envelope, Fields, Kind
from ..wire.values import unpack_value
from .client_jobs import _Job
from .protocol import MAX_JOB_FRAME

__all__ = ["ClientReplies"]

_UNREACHABLE = "Unreachable"  # error_type of a daemon that refused the connection


def _write(stream: str, text: str) -> None:
    out = sys.stderr if stream == "stderr" else sys.stdout
    out.write(text)
    out.flush()


class ClientReplies:
    """The client's connections and the handlers of what they bring; see the module
    docstring. Its state is made in `Client.__init__`."""

    curve: Any
    id: str
    _channels: dict[str, Channel]
    _jobs: dict[str, _Job]
    _lost_ids: set[str]
    _unreachable_ids: set[str]  # listed, but their address refused us
    _closing: set[asyncio.Task[None]]

    # -- replies ----------------------------------------------------------------------------

    def _channel(self, address: str) -> Channel:
        channel = self._channels.get(address)
        if channel is None or channel.closed:
            options: dict[str, Any] = {}
            if self.curve is not None:
                options = {
                    "curve": self.curve,
                    "on_refused": functools.partial(self._refused, address),
                }
            channel = Channel.connect(
                address,
                self.id.encode(),
                handler=functools.partial(self._on_reply, address),
                on_disconnect=functools.partial(self._lost, address),
                on_unreachable=functools.partial(self._unreachable, address),
                max_frame_bytes=MAX_JOB_FRAME,
                **options,
            )
            self._channels[address] = channel
        return channel

    def _on_reply(
        self, address: str, sender: bytes, env: Envelope, payload: list[memoryview]
    ) -> None:
        fields = Fields(env.body, env.kind.name)
        job = self._jobs.get(fields.get_str("job", 64))
        if job is None:
            return  # a late report of a job that ended here
        rank = fields.get_int("rank", 0, len(job.workers) - 1)
        if job.workers[rank].address != address:
            raise ProtocolError(f"{address} reported for rank {rank}, which it does not run")
        if env.kind in (Kind.JOB_RESULT, Kind.JOB_REFUSED):
            job.reported.add(rank)
        if env.kind is Kind.JOB_ACCEPTED:
            if not job.accepted[rank].done():
                job.accepted[rank].set_result(fields.get_str("group", 256))
        elif env.kind is Kind.JOB_OUTPUT:
            self._print(job, rank, fields.get_str("stream", 8), fields.get_str("text", 1 << 16))
        elif env.kind is Kind.JOB_REFUSED:
            reason = fields.get_str("reason", 1024)
            job.fail(
                rank,
                RemoteError(
                    f"worker {job.workers[rank].name} refused job {job.label}: {reason}",
                    rank=rank,
                    error_type="refused",
                    worker=job.workers[rank].name,
                ),
            )
        elif env.kind is Kind.JOB_RESULT:
            self._on_result(job, rank, fields, payload)
        else:
            raise ProtocolError(f"a worker does not send {env.kind.name}")

    def _on_result(self, job: _Job, rank: int, fields: Fields, payload: list[memoryview]) -> None:
        self._flush_output(job, rank)
        worker = job.workers[rank].name
        if fields.get_bool("ok"):
            if not payload:
                raise ProtocolError("a JobResult carries its value frames")
            try:
                value = unpack_value(payload[0], payload[1:])
            except ProtocolError as exc:
                job.fail(
                    rank,
                    RemoteError(
                        f"rank {rank} sent a malformed result: {exc}",
                        rank=rank,
                        error_type="ProtocolError",
                        worker=worker,
                    ),
                )
                return
            if not job.accepted[rank].done():
                job.accepted[rank].set_result(None)
            if not job.results[rank].done():
                job.results[rank].set_result(value)
            return
        error_type = fields.get_str("error_type", 256)
        message = fields.get_str("message", 8192)
        trace = fields.get_str("traceback", 1 << 16)
        text = f"rank {rank} ({worker}) raised {error_type}: {message}"
        if trace:
            text += f"\n\nRemote traceback (rank {rank}, {worker}):\n{trace.rstrip()}"
        job.fail(
            rank,
            RemoteError(text, rank=rank, traceback=trace, error_type=error_type, worker=worker),
        )

    def _drop_channel(self, address: str) -> None:
        channel = self._channels.pop(address, None)
        if channel is not None:  # a fresh connection for the next job, not this session
            task = asyncio.get_running_loop().create_task(channel.aclose(linger_s=0))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _unreachable(self, address: str) -> None:
        """Nothing listens at `address` any more: the daemon there died while idle."""
        self._drop_channel(address)
        for job in list(self._jobs.values()):
            for rank in job.rank_at(address):
                worker = job.workers[rank]
                self._unreachable_ids.add(worker.id)
                job.fail(
                    rank,
                    WorkerLostError(
                        f"worker {worker.name} (pid {worker.pid}) refuses connections at "
                        f"{address}: its daemon is gone (the registry lists it until its "
                        "heartbeats time out)",
                        rank=rank,
                        worker=worker.name,
                        error_type=_UNREACHABLE,
                    ),
                )

    def _lost(self, address: str) -> None:
        self._drop_channel(address)
        for job in list(self._jobs.values()):
            for rank in job.rank_at(address):
                if rank in job.submitted and not job.results[rank].done():
                    worker = job.workers[rank]
                    self._lost_ids.add(worker.id)
                    job.fail(
                        rank,
                        WorkerLostError(
                            f"worker {worker.name} (rank {rank}, {address}, pid {worker.pid}) "
                            f"disconnected while running job {job.label}: it died or was killed",
                            rank=rank,
                            worker=worker.name,
                            error_type="WorkerLost",
                        ),
                    )

    def _refused(self, address: str, reason: str) -> None:
        for job in list(self._jobs.values()):
            for rank in job.rank_at(address):
                job.fail(
                    rank,
                    RemoteError(
                        f"worker {job.workers[rank].name} at {address}: {reason}",
                        rank=rank,
                        error_type="refused",
                        worker=job.workers[rank].name,
                    ),
                )

    def _print(self, job: _Job, rank: int, stream: str, text: str) -> None:
        key = (rank, stream)
        text = job.partial.pop(key, "") + text
        *lines, rest = text.split("\n")
        if rest:
            job.partial[key] = rest
        if lines:
            job.context.run(_write, stream, "".join(f"[rank {rank}] {line}\n" for line in lines))

    def _flush_output(self, job: _Job, rank: int) -> None:
        for stream in ("stdout", "stderr"):
            rest = job.partial.pop((rank, stream), "")
            if rest:
                self._print(job, rank, stream, rest + "\n")
