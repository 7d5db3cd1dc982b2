"""What the registry shows of a running job: progress summaries, who waits for whom, and
the recent view changes (membership layer; `dsml status --watch / --serve` read it).

- **Progress summaries.** Each rank's heartbeat may carry a `summary` of its progress
  (built by dsml/communicator/summary.py from what the flight recorder reads): the
  collective it is in, the peers that call was last found waiting for, its calls per
  second and the median time split of its last calls. `read_summary` checks one from the
  wire (untrusted: every field typed and bounded); the registry keeps the latest per
  member and returns it in the status reply, as each member's `progress`.
- **Who waits for whom.** `mark_waited_for` adds to each member of a status reply the ranks
  that wait for it (`waited_by`). A rank waits for the peers its call's probe named
  (`waiting_for`: the progress log's, or the timeout's); before any probe, a rank whose
  call has run `slow_s` counts as waiting for the ranks of its epoch whose last started
  collective is older (they have not got there yet, as far as their heartbeats say).
- **View changes.** `ViewLog` keeps the last few views the registry published or adopted,
  with when and why (a member lost and how it was found, left, joined, a renewal).
"""

from __future__ import annotations

import collections
import time
from typing import Any

from ..errors import ProtocolError
from .view import Change

__all__ = ["MAX_WAITING", "SPLIT", "ViewLog", "mark_waited_for", "read_summary"]

#: the parts of a call's time, in the order of a summary's `p50_us`
SPLIT = ("total", "waiting", "wire", "reduce", "copy", "other")
MAX_WAITING = 32  # ranks a summary names as waited for (then only their count)
_MAX_KIND = 32
_KEEP_VIEWS = 16
_MAX_REASON = 512


def read_summary(raw: Any) -> dict[str, Any] | None:
    """A heartbeat's progress summary, checked (None if it has none).

    Raises:
        ProtocolError: the summary is not one (wrong types, too long).
    """
    if raw is None:
        return None
    if not isinstance(raw, dict) or len(raw) > 8:
        raise ProtocolError("Heartbeat.summary must be a small map")
    call = raw.get("call")
    if call is not None and not (
        isinstance(call, list)
        and len(call) == 3
        and _count(call[0])
        and type(call[1]) is str
        and len(call[1]) <= _MAX_KIND
        and _seconds(call[2])
    ):
        raise ProtocolError("Heartbeat.summary.call must be [cid, kind, running_s]")
    waiting = raw.get("waiting_for")
    if waiting is not None and not (
        isinstance(waiting, list)
        and len(waiting) <= MAX_WAITING
        and all(_count(r) for r in waiting)
        and _count(raw.get("waiting_n"))
    ):
        raise ProtocolError("Heartbeat.summary.waiting_for must be a short list of ranks")
    p50 = raw.get("p50_us")
    if not (isinstance(p50, list) and len(p50) == len(SPLIT) and all(_count(v) for v in p50)):
        raise ProtocolError("Heartbeat.summary.p50_us must be 6 counts of microseconds")
    if not (_seconds(raw.get("calls_per_s")) and _count(raw.get("sampled"))):
        raise ProtocolError("Heartbeat.summary needs calls_per_s and sampled")
    return {
        "call": None if call is None else list(call),
        "waiting_for": None if waiting is None else list(waiting),
        "waiting_n": raw.get("waiting_n") if waiting is not None else None,
        "calls_per_s": float(raw["calls_per_s"]),
        "p50_us": list(p50),
        "sampled": raw["sampled"],
    }


def mark_waited_for(members: list[dict[str, Any]], slow_s: float) -> list[int]:
    """Add `waited_by` (the ranks waiting for it) to each member of a status reply;
    returns the ranks someone waits for (see the module docstring).

    Each waiter names at most `MAX_WAITING` ranks (the furthest behind first), so a reply
    grows with the group, not with its square; O(n log n) for n members.
    """
    by_rank = {m["rank"]: m for m in members}
    for m in members:
        m["waited_by"] = []
    behind: dict[Any, list[tuple[int, int]]] = {}  # epoch -> (last started, rank), sorted
    for m in members:
        last = _last_started(m)
        if last is not None:
            behind.setdefault(m.get("epoch"), []).append((last, m["rank"]))
    for ranks in behind.values():
        ranks.sort()
    for waiter in members:
        for rank in _waits_for(waiter, behind.get(waiter.get("epoch"), []), slow_s):
            if rank in by_rank and rank != waiter["rank"]:
                by_rank[rank]["waited_by"].append(waiter["rank"])
    return [m["rank"] for m in members if m["waited_by"]]


def _waits_for(waiter: dict[str, Any], behind: list[tuple[int, int]], slow_s: float) -> list[int]:
    """The ranks `waiter` waits for: its probe's, or those of its epoch behind its slow
    call (`behind`: (last started, rank) of the epoch's members, sorted)."""
    progress = waiter.get("progress")
    if progress is None or progress["call"] is None:
        return []
    if progress["waiting_for"] is not None:
        return list(progress["waiting_for"])
    cid, _kind, running_s = progress["call"]
    if running_s + (waiter.get("heartbeat_age") or 0.0) < slow_s:
        return []
    return [rank for last, rank in behind[:MAX_WAITING] if last < cid]


def _last_started(member: dict[str, Any]) -> int | None:
    """The cid of the member's last started collective in its epoch, if it reported one."""
    started = member.get("started")
    if not started or started[0] != member.get("epoch"):
        return 0 if member.get("heartbeats") else None  # none yet in this epoch
    return int(started[1])


class ViewLog:
    """The last views the registry published or adopted, with why (`status()["views"]`)."""

    def __init__(self, keep: int = _KEEP_VIEWS) -> None:
        self._views: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep)

    def add(self, epoch: int, size: int, change: Change, reason: str = "") -> None:
        """A view of `size` members at `epoch` went out; `reason`: why, if the caller knows."""
        self._views.append(
            {
                "epoch": epoch,
                "at": time.time(),
                "size": size,
                "reason": (reason or _reason(change))[:_MAX_REASON],
            }
        )

    def listing(self) -> list[dict[str, Any]]:
        """Oldest first."""
        return list(self._views)

    def __repr__(self) -> str:
        last = self._views[-1]["epoch"] if self._views else None
        return f"<ViewLog {len(self._views)} views, last epoch {last}>"


def _reason(change: Change) -> str:
    """Why a view replaced the previous one, from the change itself."""
    if not change.previous:
        return f"formed with {len(change.joined)} members"
    parts = []
    if change.lost:
        parts.append(f"lost {', '.join(change.lost)}")
    if change.left:
        parts.append(f"{', '.join(m for m, _ in change.left)} left")
    if change.joined:
        at = f" at collective #{change.boundary}" if change.boundary is not None else ""
        parts.append(f"admitted {', '.join(change.joined)}{at}")
    return "; ".join(parts) or "renewed with the same members (a suspect was still connected)"


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value < 1 << 63


def _seconds(value: Any) -> bool:
    return type(value) in (int, float) and 0.0 <= value < 1e9
