"""The flight recorder: one rank's recent calls written down when a job hangs (communicator).

A flight record is what this rank knows about where it is, as one JSON file: its identity
(rank, member id, host, pid, epoch, world size), why it was written, the ring of recent
collectives that `comm.stats()` reads (`CallRecord`s, with whom each was last found
waiting for: `WaitingFor`), the point-to-point receives in flight, and, when written from
SIGUSR1, what the main thread was doing (its stack, and whether its event loop was idle
or busy in a callback).

Nothing is added to the call path: the record is built from the `CallStats` ring and the
call table only when it is written. `FlightRecorder` writes it into `CommConfig.flight_dir`
(`DSML_FLIGHT_DIR`; default off) as `rank<R>-pid<P>.json`:

- on a call's timeout and on a typed collective failure (`DsmlError`), once per process:
  the first failure is the cause, the later ones are usually its consequences;
- on SIGUSR1, every time (the handler is installed by the root communicator, only when the
  directory is set, only from the main thread and only over the default disposition);
  it runs between bytecodes of the main thread, so it works while the loop is blocked by a
  long synchronous computation, and it only reads (copies of) plain containers;
- and at `comm.dump_flight_record(path)`, always.

`dsml flight DIR` (dsml/flight.py) reads a job's files and names the stuck rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from pathlib import Path
from types import FrameType
from typing import Any

from .call_table import CallTable
from .stats import CallRecord, CallStats
from .waiting import WaitingFor

__all__ = ["FORMAT", "FlightRecorder", "install_signal_handler"]

FORMAT = "dsml-flight/1"

#: the recorders with a directory, for the SIGUSR1 handler (weak: a closed one goes away)
_RECORDERS: weakref.WeakSet[FlightRecorder] = weakref.WeakSet()


class FlightRecorder:
    """Builds and writes this rank's flight record; see the module docstring."""

    def __init__(self, table: CallTable, stats: CallStats, directory: str | None) -> None:
        self._table = table
        self._stats = stats
        self.directory = directory
        self._wrote = False  # a record of this process is in the directory already
        if directory:
            _RECORDERS.add(self)

    def record(
        self, reason: str, frame: FrameType | None = None, error: str = ""
    ) -> dict[str, Any]:
        """The flight record now (`frame`: the main thread's, when a signal interrupted it)."""
        now, wall = time.perf_counter(), time.time()
        table, links = self._table, self._table.links
        view = links.view
        member = view.members[links.rank] if view is not None else None
        calls = list(self._stats.recent)  # a copy in C: safe beside a writer in a thread
        receives = list(table.receives.items())
        return {
            "format": FORMAT,
            "reason": reason,
            "error": error,  # the failure's message, when a failure wrote it
            "dumped_at": wall,
            "identity": {
                "rank": links.rank,
                "member_id": links.member_id,
                "host": member.host if member is not None else "",
                "pid": os.getpid(),
                "epoch": links.epoch,
                "world_size": links.size,
            },
            "next_cid": table.next_cid,
            "calls": [_call(r, now) for r in calls],
            "receives": [
                {"peer": c.peer, "tag": c.tag, "epoch": c.epoch, "waiting_s": now - since}
                for c, since in receives
            ],
            "main_thread": _main_thread(frame) if frame is not None else None,
        }

    def dump(self, path: str | os.PathLike[str], reason: str = "requested") -> Path:
        """Write the record to `path` (a directory: this rank's file in it); returns it."""
        target = Path(path)
        if target.is_dir():
            target = target / self.file_name()
        _write(target, self.record(reason))
        return target

    def file_name(self) -> str:
        return f"rank{self._table.links.rank}-pid{os.getpid()}.json"

    def failed(self, reason: str, error: str = "") -> None:
        """A call failed on this rank: write the record, if none was written yet."""
        if not self.directory or self._wrote:
            return
        self._wrote = True
        try:
            _write(Path(self.directory) / self.file_name(), self.record(reason, error=error))
        except OSError as exc:  # a full disk must not turn a timeout into another error
            _say(f"dsml: flight record not written: {exc}")

    def signalled(self, frame: FrameType | None) -> None:
        """SIGUSR1: write the record now (what the main thread does included)."""
        if not self.directory:
            return
        self._wrote = True
        target = Path(self.directory) / self.file_name()
        _write(target, self.record("signal SIGUSR1", frame))
        _say(f"dsml: rank {self._table.links.rank} wrote its flight record to {target}")

    def __repr__(self) -> str:
        return f"<FlightRecorder rank={self._table.links.rank} dir={self.directory!r}>"


def install_signal_handler() -> bool:
    """Write the flight records of this process on SIGUSR1; True if installed (main thread
    only, and only where the program left SIGUSR1 at its default)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    usr1 = getattr(signal, "SIGUSR1", None)
    if usr1 is None:
        return False
    current = signal.getsignal(usr1)
    if current is _on_signal:
        return True
    if current not in (signal.SIG_DFL, None):
        return False  # the program's own handler: keep it
    signal.signal(usr1, _on_signal)
    return True


_dumping = False  # a SIGUSR1 that comes while one is handled is dropped (it would nest)


def _on_signal(_signum: int, frame: FrameType | None) -> None:
    # Runs between bytecodes of the main thread: it must never raise into that code, nor
    # run inside itself (a second signal would find the first one's frames, and its file).
    global _dumping
    if _dumping:
        return
    _dumping = True
    try:
        for recorder in list(_RECORDERS):
            try:
                recorder.signalled(frame)
            except Exception as exc:
                _say(f"dsml: flight record not written: {exc!r}")
    finally:
        _dumping = False


def _call(record: CallRecord, now: float) -> dict[str, Any]:
    d = record.as_dict()
    d["started_s_ago"] = now - record.start
    d["ended_s_ago"] = now - record.end if record.end else None
    d["waiting_for"] = _waiting(record.waiting_for, now) if record.waiting_for else None
    return d


def _waiting(waiting: WaitingFor, now: float) -> dict[str, Any]:
    return {
        "cid": waiting.cid,
        "asked_s_ago": now - waiting.asked_at,
        "missing": waiting.missing(),
        "peers": {
            str(rank): {"last_started": last, "kind": waiting.kinds.get(rank)}
            for rank, last in dict(waiting.started).items()
        },
    }


def _main_thread(frame: FrameType) -> dict[str, Any]:
    """Where the main thread was: its stack, and its event loop idle (in select) or busy."""
    stack = traceback.extract_stack(frame)
    loop = asyncio._get_running_loop()  # the main thread's own, if one runs there
    in_select = bool(stack) and stack[-1].filename.endswith("selectors.py")
    state = "no event loop" if loop is None else "idle" if in_select else "busy"
    top = stack[-1] if stack else None
    return {
        "loop": state,
        "where": f"{Path(top.filename).name}:{top.lineno} in {top.name}" if top else "",
        "line": (top.line or "") if top else "",
        "stack": traceback.format_list(stack[-12:]),
    }


def _write(target: Path, record: dict[str, Any]) -> None:
    """Write atomically: a reader never sees half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + ".part")
    with open(part, "w", encoding="utf-8") as file:
        json.dump(record, file, indent=1)
    os.replace(part, target)


def _say(line: str) -> None:
    # os.write, not print: the signal may have interrupted a write to sys.stderr
    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.write(sys.stderr.fileno(), (line + "\n").encode())
