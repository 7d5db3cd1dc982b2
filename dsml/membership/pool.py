"""The registry's list of worker daemons, idle or busy (membership layer).

A worker daemon (`dsml worker`) is not a member of the registry's group: it waits for jobs,
and each job forms a group of its own. It tells the registry every heartbeat interval who
it is, where it serves jobs and whether it is busy (WORKER_HELLO), and says goodbye when it
stops (WORKER_BYE). Clients read the list from the registry's status to pick workers. A
daemon silent for the heartbeat timeout is dropped from the list.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, ProtocolError
from ..transport import check_address
from ..wire import Fields

__all__ = ["WorkerPool", "WorkerRecord"]

_MAX_WORKERS = 4096
STATES = ("idle", "busy")


@dataclass(slots=True)
class WorkerRecord:
    id: str
    name: str
    address: str
    device: str
    host: str
    pid: int
    state: str
    job: str
    jobs_done: int
    interval: float  # seconds between its hellos
    last_seen: float

    @classmethod
    def from_hello(cls, body: Any, now: float) -> WorkerRecord:
        fields = Fields(body, "WorkerHello")
        address = fields.get_str("address", 256)
        try:
            check_address(address, "worker address")
        except ConfigError as exc:
            raise ProtocolError(str(exc)) from None
        state = fields.get_str("state", 8)
        if state not in STATES:
            raise ProtocolError(f"WorkerHello: state must be one of {STATES}")
        return cls(
            id=fields.get_str("id", 64),
            name=fields.get_str("name", 128),
            address=address,
            device=fields.get_str("device", 32),
            host=fields.get_str("host", 256),
            pid=fields.get_int("pid", 0, 1 << 31),
            state=state,
            job=fields.get_str("job", 64, optional=True) or "",
            jobs_done=fields.get_int("jobs_done"),
            interval=fields.get_float("interval", 1e-3, 3600) if "interval" in body else 1.0,
            last_seen=now,
        )

    def to_wire(self, now: float) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "address": self.address,
            "device": self.device,
            "host": self.host,
            "pid": self.pid,
            "state": self.state,
            "job": self.job,
            "jobs_done": self.jobs_done,
            "heartbeat_interval": self.interval,
            "heartbeat_age": round(now - self.last_seen, 3),
        }


def _check_speaker(sender: bytes, worker_id: str, kind: str) -> None:
    if sender != f"worker-{worker_id}".encode():
        raise ProtocolError(
            f"{kind} for worker {worker_id!r} from connection {sender[:40]!r}: a daemon "
            "speaks only for itself"
        )


class WorkerPool:
    """Worker daemons by id, as their last hello described them."""

    def __init__(self) -> None:
        self._workers: dict[str, WorkerRecord] = {}

    def hello(self, body: Any, sender: bytes) -> WorkerRecord:
        """List (or refresh) the daemon a hello describes; only its own connection
        (identity `worker-<id>`, proven by the job secret) may speak for it."""
        record = WorkerRecord.from_hello(body, time.monotonic())
        _check_speaker(sender, record.id, "WorkerHello")
        if record.id not in self._workers and len(self._workers) >= _MAX_WORKERS:
            raise ProtocolError(f"the registry lists {_MAX_WORKERS} workers already")
        self._workers[record.id] = record
        return record

    def bye(self, body: Any, sender: bytes) -> None:
        worker_id = Fields(body, "WorkerBye").get_str("id", 64)
        _check_speaker(sender.removesuffix(b".bye"), worker_id, "WorkerBye")
        self._workers.pop(worker_id, None)

    def expire(self, timeout: float) -> list[str]:
        """Drop the daemons silent for longer than timeout; returns their names."""
        now = time.monotonic()
        gone = [w for w in self._workers.values() if now - w.last_seen > timeout]
        for record in gone:
            del self._workers[record.id]
        return [w.name for w in gone]

    def listing(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        records = sorted(self._workers.values(), key=lambda w: (w.name, w.id))
        return [w.to_wire(now) for w in records]

    def __len__(self) -> int:
        return len(self._workers)
