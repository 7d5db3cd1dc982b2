"""A rank's progress in a few bytes, for its heartbeats (communicator layer).

Each heartbeat carries a `summary` that the registry keeps and `dsml status --watch /
--serve` shows (dsml/membership/live.py checks and reads it):

- `call`: `[cid, kind, running_s]` of the oldest collective of this epoch still running
  (the one the others wait in, or that waits for them), or None;
- `waiting_for`: the ranks that call was last found waiting for (its `WaitingFor`: the
  progress log's question after `progress_after`, or the timeout's probe), at most
  `MAX_WAITING` of them, and `waiting_n` how many in all; None while nobody asked;
- `calls_per_s`: collectives ended per second over the last `RATE_S` seconds;
- `p50_us`: the median of each part of the time split (total, waiting, wire, reduce,
  copy, other) over the last `SAMPLE` ended calls, in whole microseconds (a msgpack
  integer takes 1 to 5 bytes, a float 9), and `sampled` how many calls that was.

Nothing is added to a call: the summary is read from the ring of `CallRecord`s that
`comm.stats()` and the flight recorder read, in the heartbeat thread, once per beat (a
copy of the ring is taken in C, as the flight recorder does, and only plain attributes are
read). About 80 bytes in msgpack with no call running, 105 with one (one more per
rank waited for).
"""

from __future__ import annotations

import time
from typing import Any

from ..membership.live import MAX_WAITING
from .stats import CallRecord, CallStats

__all__ = ["RATE_S", "SAMPLE", "summary"]

SAMPLE = 32  # ended calls whose median time split is reported
RATE_S = 10.0  # calls per second counted over this many seconds


def summary(stats: CallStats, epoch: int) -> dict[str, Any]:
    """This rank's progress now (see the module docstring); safe from another thread."""
    now = time.perf_counter()
    calls = list(stats.recent)  # a copy in C: the runner appends in the loop's thread
    current = next((r for r in calls if r.outcome == "running" and r.epoch == epoch), None)
    ended = [r for r in calls if r.end]
    body: dict[str, Any] = {
        "call": None,
        "waiting_for": None,
        "calls_per_s": round(_rate(calls, ended, now), 3),
        "p50_us": _p50_us(ended[-SAMPLE:]),
        "sampled": min(len(ended), SAMPLE),
    }
    if current is not None:
        body["call"] = [current.cid, current.kind, round(now - current.start, 3)]
        waiting = current.waiting_for
        if waiting is not None:
            missing = waiting.missing()  # the loop thread only sets values of its keys
            body["waiting_for"] = missing[:MAX_WAITING]
            body["waiting_n"] = len(missing)
    return body


def _rate(calls: list[CallRecord], ended: list[CallRecord], now: float) -> float:
    """Calls ended per second over the last RATE_S seconds (or since the oldest call the
    ring holds, when that is more recent: the ring keeps a fixed number of calls)."""
    if not calls:
        return 0.0
    window = min(RATE_S, now - calls[0].start)
    if window <= 0.0:
        return 0.0
    return sum(1 for r in ended if r.end > now - window) / window


def _p50_us(ended: list[CallRecord]) -> list[int]:
    if not ended:
        return [0] * 6
    parts = [
        sorted(values)[len(values) // 2] for values in zip(*(_split(r) for r in ended), strict=True)
    ]
    return [round(v * 1e6) for v in parts]


def _split(r: CallRecord) -> tuple[float, float, float, float, float, float]:
    total = r.end - r.start
    other = max(0.0, total - r.waiting_s - r.wire_s - r.reduce_s - r.copy_s)
    return (total, r.waiting_s, r.wire_s, r.reduce_s, r.copy_s, other)
