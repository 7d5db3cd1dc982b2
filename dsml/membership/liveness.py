"""Who the registry may declare dead, and when it must not trust its own clock (membership).

Pure decisions for the registry's watchdog, kept apart so each rule is tested alone:

- **The registry being unreachable is not the members being dead.** Members silent for
  the heartbeat timeout are evicted only if they could not be running on without the
  registry: a group may go on without it only as a strict majority of its view (see
  `agreement`), so silent members that are no strict majority are evicted (the registry
  and the rest are the group), but when the silent ones are a strict majority the likelier
  story is that the registry is the one cut off (a partition, a frozen host), and evicting
  them would make a second group (`evictable`). Silent members whose connection to the
  registry is gone too (the process died) never count as a possible group.
- **A frozen registry does not count the freeze against the members.** The watchdog ticks
  every period; when a tick comes much later than asked (the process was stopped, the
  host hung), `StallDetector` reports the gap and the registry re-learns the members as
  after a restart: everyone's last heartbeat counts from now, with a full timeout of grace.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Liveness", "StallDetector", "evictable"]


@dataclass(slots=True)
class Liveness:
    """What the registry knows of one member's health and progress."""

    last_seen: float
    epoch: int = 0
    beats: int = 0
    view_sent: float = 0.0  # when the current view was last sent again to it
    asked_view: float = 0.0  # when it was last asked for its view (it reported a newer one)
    started: list[Any] | None = None  # [epoch, cid, description] of the last started call
    finished: list[Any] | None = None  # ... and of the last finished one
    counters: dict[str, int] = field(default_factory=dict)  # held, dropped, ... messages
    progress: dict[str, Any] | None = None  # its last progress summary (live.read_summary)


def evictable(
    members: Sequence[str],
    live: Mapping[str, Liveness],
    now: float,
    timeout: float,
    connected: Callable[[str], bool],
) -> tuple[list[str], list[str]]:
    """(silent members to evict now, silent members kept: they may be a running group).

    See the module docstring.
    """
    silent = [m for m in members if now - live[m].last_seen > timeout]
    if not silent:
        return [], []
    still_there = [m for m in silent if connected(m)]
    if 2 * len(still_there) > len(members):
        gone = [m for m in silent if m not in still_there]
        return gone, still_there
    return silent, []


@dataclass(slots=True)
class StallDetector:
    """Notices that the process did not run for a while (stopped, or its host hung).

    `tick(now)` is called every `period` seconds; it returns by how much the tick came
    late (0 when less than `tolerance`). The registry credits that time to every member:
    while it did not run, it could not hear them.
    """

    period: float
    tolerance: float
    last: float | None = None
    stalls: int = 0

    def tick(self, now: float) -> float:
        last, self.last = self.last, now
        if last is None:
            return 0.0
        late = now - last - self.period
        if late > self.tolerance:
            self.stalls += 1
            return late
        return 0.0
