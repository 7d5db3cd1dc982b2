"""Where the time of each collective went: `comm.stats()` and the trace (communicator layer).

Every collective a communicator runs leaves one `CallRecord` in a bounded ring of recent
calls: what it was (kind, bytes, algorithm), when it ran, how it ended, whom it was found
waiting for if it ran long (`WaitingFor`, waiting.py), and how its time split:

* `waiting_s`: blocked in a receive for the first message of a peer in this call (the peer
  had not got there yet: a late rank shows up here);
* `wire_s`: blocked on the transport otherwise: later receives of the call (data in
  flight), a send waiting for room in a full queue, waiting until ZeroMQ has sent a buffer;
* `reduce_s`: in reductions (sum, max, ... and the scaling of `avg`);
* `copy_s`: copying data in and out of the caller's array and work buffers;
* `other_s`: the rest (planning, scheduling on the event loop, Python).

The record of the running call is found through a context variable, set in the call's own
task, so the array backend (`TimedBackend`) and the `Call` add to it without being passed
it. With torch already imported (never imported here), each collective is also a
`torch.profiler.record_function` span, so it shows in a torch profile beside the model.
"""

from __future__ import annotations

import collections
import contextvars
import sys
import time
from dataclasses import dataclass
from typing import Any, cast

from ..collectives import DTYPES
from ..collectives.arrays import Array, ArrayBackend
from ..collectives.ops import ReduceOp
from ..engine.trace import Span
from ..wire import Fingerprint
from .waiting import WaitingFor

__all__ = [
    "WAITING",
    "WIRE",
    "CallRecord",
    "CallStats",
    "TimedBackend",
    "current",
    "profiler_span",
    "ran",
    "timed",
]

KEEP = 256  # recent calls kept per communicator
WAITING, WIRE = 0, 1  # the categories of blocked time

#: the record of the collective running in this task (None outside one)
current: contextvars.ContextVar[CallRecord | None] = contextvars.ContextVar(
    "dsml_call_record", default=None
)


def ran(algorithm: str) -> None:
    """Record which algorithm the running collective really ran (what `auto` chose, or
    the ring when an asked-for shared-memory algorithm could not run)."""
    record = current.get()
    if record is not None:
        record.algorithm = algorithm


@dataclass(slots=True)
class CallRecord:
    """One collective as it ran on this rank (see the module docstring)."""

    kind: str
    cid: int
    epoch: int
    nbytes: int
    algorithm: str | None
    start: float  # time.perf_counter()
    end: float = 0.0
    outcome: str = "running"
    waiting_s: float = 0.0
    wire_s: float = 0.0
    reduce_s: float = 0.0
    copy_s: float = 0.0
    #: peers a message already came from (made on the first receive)
    heard: set[int] | None = None
    #: whom the call was last found waiting for, and where each was seen: set only when
    #: it ran long (the progress log's question, the timeout's probe; waiting.py)
    waiting_for: WaitingFor | None = None
    #: per category (WAITING, WIRE): waits open now and since when. The tasks of one call
    #: may wait at once (a rooted collective confirms beside its data): overlapping waits
    #: of a category count once. Plain fields, so that a call's record costs little.
    _open_waiting: int = 0
    _open_wire: int = 0
    _since_waiting: float = 0.0
    _since_wire: float = 0.0

    def enter(self, category: int) -> int:
        """Start a wait of `category` (WAITING or WIRE); pass the result to `leave`."""
        if category == WAITING:
            if self._open_waiting == 0:
                self._since_waiting = time.perf_counter()
            self._open_waiting += 1
        else:
            if self._open_wire == 0:
                self._since_wire = time.perf_counter()
            self._open_wire += 1
        return category

    def enter_receive(self, peer: int) -> int:
        """Start a receive from `peer`: waiting for the peer until its first message came,
        then (later messages of the call) for the wire."""
        if self.heard is None:
            self.heard = {peer}
        elif peer in self.heard:
            return self.enter(WIRE)
        else:
            self.heard.add(peer)
        return self.enter(WAITING)

    def leave(self, category: int) -> None:
        if category == WAITING:
            self._open_waiting -= 1
            if self._open_waiting == 0:
                self.waiting_s += time.perf_counter() - self._since_waiting
        else:
            self._open_wire -= 1
            if self._open_wire == 0:
                self.wire_s += time.perf_counter() - self._since_wire

    @property
    def total_s(self) -> float:
        return (self.end or time.perf_counter()) - self.start

    def as_dict(self) -> dict[str, Any]:
        total = self.total_s
        spent = self.waiting_s + self.wire_s + self.reduce_s + self.copy_s
        return {
            "kind": self.kind,
            "cid": self.cid,
            "epoch": self.epoch,
            "bytes": self.nbytes,
            "algorithm": self.algorithm,
            "outcome": self.outcome,
            "total_s": total,
            "waiting_s": self.waiting_s,
            "wire_s": self.wire_s,
            "reduce_s": self.reduce_s,
            "copy_s": self.copy_s,
            "other_s": max(0.0, total - spent),
        }

    def describe(self) -> str:
        """One log line's worth: `all_reduce #3 (ring, 4096 B) ok in 1.234 ms (...)`."""
        d = self.as_dict()
        parts = ", ".join(
            f"{name} {d[f'{name}_s'] * 1e3:.3f}"
            for name in ("waiting", "wire", "reduce", "copy", "other")
        )
        what = f"{self.algorithm}, " if self.algorithm else ""
        return (
            f"{self.kind} #{self.cid} ({what}{self.nbytes} B) {self.outcome} in "
            f"{d['total_s'] * 1e3:.3f} ms ({parts} ms)"
        )

    def span(self) -> Span:
        """The call as a span of the engine's trace format, on the "collectives" track."""
        return Span(
            name=f"{self.kind} #{self.cid}",
            seq=self.cid,
            place="collectives",
            thread=0,
            start=self.start,
            end=self.end or time.perf_counter(),
            pushed=self.start,
            outcome=self.outcome,
            reads=(),
            mutates=(),
            args={k: v for k, v in self.as_dict().items() if k not in ("kind", "cid")},
        )


class CallStats:
    """The recent calls of one communicator (the runner writes, `comm.stats()` reads)."""

    def __init__(self, keep: int = KEEP) -> None:
        self.recent: collections.deque[CallRecord] = collections.deque(maxlen=keep)

    def begin(
        self, kind: str, cid: int, epoch: int, fingerprint: Fingerprint, nbytes: int | None = None
    ) -> CallRecord:
        size = _nbytes(fingerprint) if nbytes is None else nbytes
        record = CallRecord(kind, cid, epoch, size, fingerprint.algorithm, time.perf_counter())
        self.recent.append(record)
        return record

    def __repr__(self) -> str:
        return f"<CallStats {len(self.recent)} recent calls>"


def _nbytes(fp: Fingerprint) -> int:
    if fp.count is None or fp.dtype is None or fp.dtype not in DTYPES:
        return 0
    return fp.count * DTYPES[fp.dtype].itemsize


def profiler_span(kind: str) -> Any:
    """An entered `torch.profiler.record_function("dsml::<kind>")` if torch is already
    imported, else None; the caller exits it (`__exit__(None, None, None)`)."""
    torch = sys.modules.get("torch")
    profiler = getattr(torch, "profiler", None) if torch is not None else None
    if profiler is None:
        return None
    span = profiler.record_function(f"dsml::{kind}")
    span.__enter__()
    return span


_now = time.perf_counter


def _add_copy(start: float) -> None:
    record = current.get()
    if record is not None:
        record.copy_s += _now() - start


def _add_reduce(start: float) -> None:
    record = current.get()
    if record is not None:
        record.reduce_s += _now() - start


class TimedBackend:
    """An array backend that adds the time of reductions and copies to the current call.

    Every other attribute is the wrapped backend's (whatever methods it has).
    """

    def __init__(self, inner: ArrayBackend) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        setattr(self, name, value)  # found in the instance from now on (backends stay put)
        return value

    def copy_flat(self, x: Array, out: Array) -> None:
        start = _now()
        self.inner.copy_flat(x, out)
        _add_copy(start)

    def copy_out(self, flat: Array, x: Array) -> None:
        start = _now()
        self.inner.copy_out(flat, x)
        _add_copy(start)

    def write(self, out: Array, lo: int, hi: int, data: memoryview) -> None:
        start = _now()
        self.inner.write(out, lo, hi, data)
        _add_copy(start)

    def copy(self, out: Array, lo: int, hi: int, src: Array) -> None:
        start = _now()
        self.inner.copy(out, lo, hi, src)
        _add_copy(start)

    def reduce(
        self,
        op: ReduceOp,
        out: Array,
        lo: int,
        hi: int,
        local: Array,
        data: memoryview,
        *,
        data_first: bool,
    ) -> None:
        start = _now()
        self.inner.reduce(op, out, lo, hi, local, data, data_first=data_first)
        _add_reduce(start)

    def combine(self, op: ReduceOp, local: Array, lo: int, hi: int, data: memoryview) -> Array:
        start = _now()
        result = self.inner.combine(op, local, lo, hi, data)
        _add_reduce(start)
        return result

    def scale(self, out: Array, lo: int, hi: int, world_size: int) -> None:
        start = _now()
        self.inner.scale(out, lo, hi, world_size)
        _add_reduce(start)

    def __repr__(self) -> str:
        return f"<TimedBackend {self.inner!r}>"


#: the timed twin of each backend seen (a few: numpy, one per GPU), made once
_TIMED: dict[int, tuple[ArrayBackend, ArrayBackend]] = {}


def timed(be: ArrayBackend) -> ArrayBackend:
    """`be`, timing its reductions and copies into the running call's record."""
    if isinstance(be, TimedBackend):
        return be
    known = _TIMED.get(id(be))
    if known is not None and known[0] is be:
        return known[1]
    twin = cast(ArrayBackend, TimedBackend(be))
    _TIMED[id(be)] = (be, twin)  # keeps be alive, so its id is not reused
    return twin
