"""Rate-limited warnings: one line per key per interval, with counts (membership layer).

A hostile or broken sender can make a member drop thousands of messages a second; one log
line each would flood the log (and slow the member down). `RateLimitedLog.warning(key,
...)` writes the first occurrence of a key at once, then at most one line per `interval_s`
for that key, saying how many were suppressed since the last line.

(A small helper of its own here: `dsml/log.py`, the logging helpers, did not have one when
this was written; it can move there.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["RateLimitedLog"]

_MAX_KEYS = 4096  # keys remembered (a flood from many fake senders must not grow this)


@dataclass(slots=True)
class _Seen:
    last: float
    suppressed: int = 0


@dataclass(slots=True)
class RateLimitedLog:
    """Writes `logger.warning` lines, at most one per key per `interval_s`."""

    logger: logging.Logger
    interval_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    lines: int = 0  # lines written
    suppressed: int = 0  # occurrences not written (counted in the next line of their key)
    _seen: dict[str, _Seen] = field(default_factory=dict)

    def warning(self, key: str, message: str, *args: object) -> bool:
        """Log `message % args` for `key` unless one was written within the interval;
        returns whether a line was written."""
        now = self.clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen.last < self.interval_s:
            seen.suppressed += 1
            self.suppressed += 1
            return False
        repeats = seen.suppressed if seen is not None else 0
        if seen is None and len(self._seen) >= _MAX_KEYS:
            self._seen.pop(next(iter(self._seen)))
        self._seen[key] = _Seen(last=now)
        suffix = f" ({repeats} more like it since the last such line)" if repeats else ""
        self.logger.warning(message + "%s", *args, suffix)
        self.lines += 1
        return True
