"""The client's records: workers as the registry lists them, and one job (daemon layer).

`WorkerInfo` is one worker daemon as the registry's status lists it. `_Job` is the
client's side of one job it runs: per rank, the worker's acceptance (with the job's
group address from rank 0) and its outcome, the errors in the order they arrived, and
which of them is the root cause (not a consequence of another rank's failure).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import DsmlError, RemoteError, caused_by_another_rank

__all__ = ["WorkerInfo"]

#: Besides aborts and membership changes (errors.caused_by_another_rank): errors a rank
#: gets when another failed first (its job cancelled, or a collective left waiting).
_ALSO_CONSEQUENCES = frozenset({"CancelledError", "dsml.errors.CollectiveTimeoutError"})


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """One worker daemon as the registry lists it."""

    name: str
    address: str
    state: str  # "idle" or "busy"
    device: str
    host: str
    pid: int
    job: str  # the job it runs ("" when idle)
    jobs_done: int
    heartbeat_age: float
    id: str
    heartbeat_interval: float = 1.0

    @property
    def silent(self) -> bool:
        """No hello for three intervals: probably dead (the registry drops it later)."""
        return self.heartbeat_age > 3 * self.heartbeat_interval + 0.5

    @classmethod
    def from_status(cls, entry: dict[str, Any]) -> WorkerInfo:
        return cls(
            name=entry["name"],
            address=entry["address"],
            state=entry["state"],
            device=entry["device"],
            host=entry["host"],
            pid=entry["pid"],
            job=entry.get("job", ""),
            jobs_done=entry.get("jobs_done", 0),
            heartbeat_age=entry.get("heartbeat_age", 0.0),
            id=entry["id"],
            heartbeat_interval=entry.get("heartbeat_interval", 1.0),
        )


class _Job:
    """The client's side of one job: per rank, its acceptance and its outcome."""

    def __init__(self, job_id: str, workers: Sequence[WorkerInfo], label: str) -> None:
        loop = asyncio.get_running_loop()
        self.id = job_id
        self.label = label
        self.workers = list(workers)
        self.accepted: list[asyncio.Future[str | None]] = [loop.create_future() for _ in workers]
        self.results: list[asyncio.Future[Any]] = [loop.create_future() for _ in workers]
        self.submitted: set[int] = set()
        self.reported: set[int] = set()  # ranks that sent JobResult or JobRefused
        self.cancelled = False  # JobCancel went out (once is enough)
        self.errors: list[RemoteError] = []  # in the order they arrived
        self.closed: DsmlError | None = None  # the client was closed while it ran
        self.partial: dict[tuple[int, str], str] = {}  # an output line still being written
        self.config: dict[str, Any] = {}  # CommConfig settings for the job's communicator
        # The caller's context: output printed in it reaches the caller's notebook cell
        # (ipykernel routes output by a context variable; replies arrive in the context of
        # whichever call opened the connection).
        self.context = contextvars.copy_context()
        for future in self.results:
            future.add_done_callback(_consume)

    def rank_at(self, address: str) -> list[int]:
        return [r for r, w in enumerate(self.workers) if w.address == address]

    def fail(self, rank: int, error: RemoteError) -> None:
        if not self.accepted[rank].done():
            self.accepted[rank].set_result(None)
        if not self.results[rank].done():
            self.errors.append(error)
            self.results[rank].set_exception(error)

    def root_cause(self) -> DsmlError:
        if self.closed is not None:  # the workers' CancelledErrors only follow from it
            return self.closed
        for error in self.errors:
            kind = error.error_type
            if kind not in _ALSO_CONSEQUENCES and not caused_by_another_rank(kind):
                return error
        return self.errors[0]


def _consume(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: a failure we reported another way is not "never"
