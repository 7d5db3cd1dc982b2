"""Logging for the library and the `dsml` command (leaf module, importable by every layer).

Every dsml logger lives under the "dsml" logger. Nothing is printed until a program asks
for it: `dsml` commands call `configure()` with `--log-level`; a script started with
`DSML_LOG_LEVEL=debug` gets the same when it imports dsml. Each line names the rank and the
epoch where they are known:

    14:55:01.123 WARNING  dsml.transport [rank 2 epoch 3] dropped a malformed message ...

A logger bound to a communicator (`bind(logger, lambda: (rank, epoch))`) fills them in per
line; elsewhere they come from `set_context()` or, in a rank started by `dsml run`, from
DSML_RANK.

Repeated warnings go through a `Throttle`: at most one line per key (a sender, a peer) per
interval, and the next line that gets through says how many were suppressed.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, TextIO, TypeAlias

__all__ = [
    "LEVELS",
    "Throttle",
    "bind",
    "configure",
    "configure_from_env",
    "debugging",
    "parse_level",
    "set_context",
]

#: the names DSML_LOG_LEVEL and --log-level accept, mildest last
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)-7s %(name)s %(where)s%(message)s"
_DATE_FORMAT = "%H:%M:%S"
AnyLogger: TypeAlias = "logging.Logger | logging.LoggerAdapter[logging.Logger]"
_context: dict[str, int | None] = {"rank": None, "epoch": None}


def parse_level(text: str) -> int:
    """The logging level named by `text` (debug, info, warning, error; any case).

    Raises:
        ValueError: an unknown name; the message lists the valid ones.
    """
    try:
        return LEVELS[text.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown log level {text!r}: use one of {', '.join(LEVELS)}") from None


def set_context(*, rank: int | None = None, epoch: int | None = None) -> None:
    """Set this process's rank and epoch, shown on lines that carry no communicator's own."""
    if rank is not None:
        _context["rank"] = rank
    if epoch is not None:
        _context["epoch"] = epoch


class _Where(logging.Filter):
    """Adds `record.where`: "[rank r epoch e] " from the record, else the process context."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = getattr(record, "rank", None)
        epoch = getattr(record, "epoch", None)
        if rank is None:
            rank, epoch = _context["rank"], epoch if epoch is not None else _context["epoch"]
        parts = [] if rank is None else [f"rank {rank}"]
        if epoch is not None:
            parts.append(f"epoch {epoch}")
        record.where = f"[{' '.join(parts)}] " if parts else ""
        return True


class _StderrHandler(logging.StreamHandler[TextIO]):
    """Writes to whatever sys.stderr is at the time of each line (pytest swaps it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:  # StreamHandler.__init__ assigns it
        pass


def configure(level: str | int = "warning", *, stream: TextIO | None = None) -> None:
    """Show dsml's log lines of `level` and above on `stream` (default: the current stderr).

    Calling it again changes the level and the stream; it never adds a second handler.
    """
    logger = logging.getLogger("dsml")
    logger.setLevel(parse_level(level) if isinstance(level, str) else level)
    for old in [h for h in logger.handlers if getattr(h, "_dsml", False)]:
        logger.removeHandler(old)
    handler: logging.Handler = _StderrHandler() if stream is None else logging.StreamHandler(stream)
    handler._dsml = True  # type: ignore[attr-defined]
    handler.addFilter(_Where())
    handler.setFormatter(logging.Formatter(_FORMAT, _DATE_FORMAT))
    logger.addHandler(handler)
    logger.propagate = False  # one line per message, whatever the root logger has


def configure_from_env(environ: Mapping[str, str] | None = None) -> None:
    """Apply DSML_LOG_LEVEL if it is set; also take the rank from DSML_RANK (`dsml run`).

    An invalid level is reported once on stderr and ignored, rather than failing an import.
    """
    env = os.environ if environ is None else environ
    if env.get("DSML_RANK", "").isdigit():
        set_context(rank=int(env["DSML_RANK"]))
    text = env.get("DSML_LOG_LEVEL")
    if not text:
        return
    try:
        configure(text)
    except ValueError as exc:
        print(f"dsml: DSML_LOG_LEVEL: {exc}", file=sys.stderr)


def debugging(environ: Mapping[str, str] | None = None) -> bool:
    """Whether DSML_LOG_LEVEL asks for debug lines (an invalid value does not)."""
    env = os.environ if environ is None else environ
    try:
        return parse_level(env.get("DSML_LOG_LEVEL") or "warning") <= logging.DEBUG
    except ValueError:
        return False


class _Bound(logging.LoggerAdapter[logging.Logger]):
    def __init__(self, logger: logging.Logger, where: Callable[[], tuple[int, int]]) -> None:
        super().__init__(logger, {})
        self._where = where

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        rank, epoch = self._where()
        kwargs["extra"] = {"rank": rank, "epoch": epoch, **(kwargs.get("extra") or {})}
        return msg, kwargs


def bind(
    logger: logging.Logger, where: Callable[[], tuple[int, int]]
) -> logging.LoggerAdapter[logging.Logger]:
    """A logger whose lines carry `where()` = (rank, epoch), asked for at each line."""
    return _Bound(logger, where)


class Throttle:
    """At most one log line per key per `interval_s`; the next one counts those held back.

    A flood of dropped messages from one sender gives one line per 10 s:

        throttle = Throttle(10.0)
        throttle.warning(log, sender, "dropped a malformed message from %r", sender)

    Keys are remembered up to `max_keys` (the oldest forgotten first), so a stream of
    distinct keys cannot grow memory without bound.
    """

    def __init__(
        self,
        interval_s: float = 10.0,
        *,
        max_keys: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.max_keys = max_keys
        self._clock = clock
        #: key -> [time of the last line shown, lines suppressed since]
        self._keys: OrderedDict[Any, list[float]] = OrderedDict()
        self.suppressed = 0  # in all, for counters and tests

    def allow(self, key: Any) -> tuple[bool, int]:
        """(whether a line for `key` may be shown now, how many were suppressed before it)."""
        now = self._clock()
        entry = self._keys.get(key)
        if entry is not None and now - entry[0] < self.interval_s:
            entry[1] += 1
            self.suppressed += 1
            return False, 0
        held = int(entry[1]) if entry is not None else 0
        self._keys[key] = [now, 0]
        self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
        return True, held

    def log(self, logger: AnyLogger, level: int, key: Any, msg: str, *args: Any) -> bool:
        """Log `msg % args` at `level` unless `key` had a line within the interval."""
        if not logger.isEnabledFor(level):
            return False
        shown, held = self.allow(key)
        if shown:
            if held:
                msg += f" ({held} similar lines suppressed since the last one)"
            logger.log(level, msg, *args)
        return shown

    def warning(self, logger: AnyLogger, key: Any, msg: str, *args: Any) -> bool:
        """`log` at WARNING."""
        return self.log(logger, logging.WARNING, key, msg, *args)

    def __repr__(self) -> str:
        return (
            f"<Throttle every {self.interval_s:g} s, {len(self._keys)} keys, "
            f"{self.suppressed} suppressed>"
        )
