"""Op timelines in the Chrome trace-event format, for ui.perfetto.dev (engine layer).

With `Engine(trace=True)` every op leaves one `Span` per place it ran: a plain function
leaves a "pool" span on its worker thread, a coroutine a "loop" span, and a plain
function that returned an awaitable both (the function on its thread, then the await on
the loop). Times come from `time.perf_counter()`, the same clock in every thread.

`write()` turns spans into complete events (`"ph": "X"`, `ts`/`dur` in microseconds
since the engine was created). Each pool thread is one track. Loop spans overlap one
another (many collectives can be in flight at once) and a track must hold properly nested
slices, so loop spans are packed into as few "loop" lanes as possible (interval
partitioning by start time). A communicator adds its collectives as spans of their own
place, "collectives" (packed into lanes the same way, their timings in `args`), through
`chrome_trace(..., extra=...)`. Open the file at https://ui.perfetto.dev ("Open trace
file") or chrome://tracing to see compute and communication overlap.
"""

from __future__ import annotations

import heapq
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from os import PathLike
from typing import Any

__all__ = ["Span", "TraceRecorder"]

_PID = 1
_POOL_TID_BASE = 1000


@dataclass(frozen=True, slots=True)
class Span:
    """Where and when one op (or one phase of it) ran; times are perf_counter seconds."""

    name: str
    seq: int
    place: str  # "pool" or "loop"
    thread: int  # the worker thread's ident for "pool", 0 for "loop"
    start: float
    end: float
    pushed: float
    outcome: str
    reads: tuple[str, ...]
    mutates: tuple[str, ...]
    args: dict[str, Any] | None = None  # more to show with the slice (collectives: timings)


class TraceRecorder:
    """Collects spans in memory (one small object per op phase) until written."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self.spans: list[Span] = []

    def add(self, span: Span) -> None:
        """Record one span."""
        self.spans.append(span)

    def chrome_trace(self, process_name: str, extra: Iterable[Span] = ()) -> dict[str, Any]:
        """Return the whole trace as a JSON-able dict, with `extra` spans (a communicator's
        collectives) beside the recorded ones."""
        spans = [*self.spans, *extra]
        # Time 0 is the recorder's start, or the earliest span if one began before it (a
        # communicator's collectives made before its engine was): Perfetto refuses ts < 0.
        self.origin = min([self.origin, *(span.start for span in spans)])
        events = [_meta("process_name", 0, {"name": process_name})]
        events += self._pool_events(spans)
        for place, title, first_tid in (
            ("loop", "event loop", 1),
            ("collectives", "collectives", 500),
        ):
            events += self._lane_events([s for s in spans if s.place == place], title, first_tid)
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write(
        self, path: str | PathLike[str], process_name: str, extra: Iterable[Span] = ()
    ) -> None:
        """Write the trace to `path` as JSON."""
        with open(path, "w", encoding="utf-8") as file:
            json.dump(self.chrome_trace(process_name, extra), file)

    def _pool_events(self, spans: list[Span]) -> list[dict[str, Any]]:
        tids: dict[int, int] = {}
        events: list[dict[str, Any]] = []
        for span in spans:
            if span.place != "pool":
                continue
            if span.thread not in tids:
                tid = tids[span.thread] = _POOL_TID_BASE + len(tids)
                events.append(_meta("thread_name", tid, {"name": f"pool thread {len(tids)}"}))
                events.append(_meta("thread_sort_index", tid, {"sort_index": tid}))
            events.append(self._event(span, tids[span.thread]))
        return events

    def _lane_events(self, spans: list[Span], title: str, first_tid: int) -> list[dict[str, Any]]:
        """Overlapping spans packed into as few lanes (tracks) as possible."""
        free: list[tuple[float, int]] = []  # (end of the lane's last span, lane's tid)
        lanes = 0
        events: list[dict[str, Any]] = []
        for span in sorted(spans, key=lambda s: s.start):
            if free and free[0][0] <= span.start:
                _, lane = heapq.heappop(free)
            else:
                lane = first_tid + lanes
                lanes += 1
                events.append(_meta("thread_name", lane, {"name": f"{title}, lane {lanes}"}))
                events.append(_meta("thread_sort_index", lane, {"sort_index": lane}))
            heapq.heappush(free, (span.end, lane))
            events.append(self._event(span, lane))
        return events

    def _event(self, span: Span, tid: int) -> dict[str, Any]:
        return {
            "name": span.name,
            "cat": span.place,
            "ph": "X",
            "ts": (span.start - self.origin) * 1e6,
            "dur": max(0.0, span.end - span.start) * 1e6,
            "pid": _PID,
            "tid": tid,
            "args": span.args
            if span.args is not None
            else {
                "seq": span.seq,
                "outcome": span.outcome,
                "read": list(span.reads),
                "mutate": list(span.mutates),
                "queued_us": max(0.0, span.start - span.pushed) * 1e6,
            },
        }

    def __repr__(self) -> str:
        return f"<TraceRecorder spans={len(self.spans)}>"


def _meta(name: str, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": _PID, "tid": tid, "args": args}
