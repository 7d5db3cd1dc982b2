"""What a rank prints when it ends on an uncaught exception (leaf module, beside `log`).

A collective that fails fails on every rank, and Python's traceback of it is mostly dsml's
own frames (transport, plans, shared memory) with the same message repeated through its
chained exceptions. `ReportHook`, installed as `sys.excepthook`, prints instead:

- for a `DsmlError`: the traceback of the user's frames only (dsml's and asyncio's frames
  left out), then the error's message, once, with a header line saying how to see all:

      Traceback (most recent call last, your frames only; DSML_TRACEBACK=1 shows all):
        File "train.py", line 13, in main
          await comm.all_reduce(grad)
      dsml.errors.CollectiveMismatchError: collective #2 does not match across ranks: ...

- for a `KeyboardInterrupt` (Ctrl-C, or `dsml run` stopping the ranks): one line,
  `interrupted (KeyboardInterrupt) in main at train.py:15`; Python still ends the process
  by SIGINT, as it does for an uncaught KeyboardInterrupt (a shell sees exit code 130);
- for any other exception: Python's traceback, unchanged.

`DSML_TRACEBACK=1` (`dsml run --traceback`) or `DSML_LOG_LEVEL=debug` keeps Python's full
traceback for every exception. `install()` puts the hook in place only where the program
has not set a hook of its own; `dsml run`'s ranks and `dsml.init()` call it.
"""

from __future__ import annotations

import asyncio
import os
import runpy
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType

from . import log
from .errors import DsmlError

__all__ = [
    "HEADER",
    "ReportHook",
    "full_traceback",
    "install",
    "interrupt_line",
    "short_report",
    "user_frames",
]

Trim = Callable[[TracebackType | None], TracebackType | None]

#: the first line of a short report (the launcher's summary looks for "Traceback (most recent")
HEADER = "Traceback (most recent call last, your frames only; DSML_TRACEBACK=1 shows all):"
_OFF = ("", "0", "false", "no", "off")
_CAUSES_SHOWN = 3  # explicit causes (`raise ... from exc`) named under the message, at most


def _folder(path: str) -> str:
    return os.path.dirname(os.path.abspath(path)) + os.sep


#: frames from these files are machinery, not the user's: dsml, asyncio's event loop, runpy
_HIDDEN_FOLDERS = (_folder(__file__), _folder(asyncio.__file__))
_HIDDEN_FILES = (os.path.abspath(runpy.__file__), "<frozen runpy>")


def full_traceback(environ: Mapping[str, str] | None = None) -> bool:
    """Whether Python's full traceback was asked for: DSML_TRACEBACK=1 or DSML_LOG_LEVEL=debug."""
    env = os.environ if environ is None else environ
    wanted = env.get("DSML_TRACEBACK", "").strip().lower() not in _OFF
    return wanted or log.debugging(env)


def _is_users(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen runpy>, <string>, <stdin>
        return filename not in _HIDDEN_FILES
    path = os.path.abspath(filename)
    return path not in _HIDDEN_FILES and not path.startswith(_HIDDEN_FOLDERS)


def user_frames(tb: TracebackType | None) -> traceback.StackSummary:
    """The frames of `tb` outside dsml, asyncio and runpy, outermost first."""
    frames = traceback.extract_tb(tb)
    return traceback.StackSummary.from_list([f for f in frames if _is_users(f.filename)])


def _next(exc: BaseException) -> BaseException | None:
    """What Python prints before `exc`: its cause, else its context unless suppressed."""
    if exc.__cause__ is not None:
        return exc.__cause__
    return None if exc.__suppress_context__ else exc.__context__


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then what it was raised from or while handling, newest first, each once."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = _next(current)


def _error_text(exc: BaseException) -> str:
    """`module.Type: message` as Python prints it (notes included), without the newline."""
    return "".join(traceback.format_exception_only(type(exc), exc)).rstrip("\n")


def _causes(exc: BaseException, shown: str) -> list[str]:
    """A line for each explicit cause (`raise ... from cause`) that adds to `shown`: a
    cause whose message is already part of what is shown is not repeated."""
    lines: list[str] = []
    cause = exc.__cause__
    while cause is not None and len(lines) < _CAUSES_SHOWN:
        first = _error_text(cause).splitlines()[0]
        if not str(cause) or str(cause) not in shown:
            lines.append(f"  caused by {first}")
            shown += first
        cause = cause.__cause__
    return lines


def short_report(exc: BaseException, tb: TracebackType | None) -> str:
    """The report of a dsml error: the user's frames, then its message once."""
    text = _error_text(exc)
    lines = [HEADER, *user_frames(tb).format(), text, *_causes(exc, text)]
    return "\n".join(line.rstrip("\n") for line in lines) + "\n"


def interrupt_line(exc: BaseException, tb: TracebackType | None) -> str:
    """`interrupted (KeyboardInterrupt) in main at train.py:15`: where the user's code was
    (the innermost of the user's frames in the chain: asyncio.run raises its own
    KeyboardInterrupt while handling the cancelled task's CancelledError)."""
    where = None
    for link in _chain(exc):
        frames = user_frames(tb if link is exc else link.__traceback__)
        where = frames[-1] if frames else where
    at = f" in {where.name} at {where.filename}:{where.lineno}" if where is not None else ""
    return f"interrupted ({type(exc).__name__}){at}\n"


class ReportHook:
    """`sys.excepthook`: short reports of dsml errors and interrupts (module docstring).

    Args:
        full: print Python's traceback for every exception (DSML_TRACEBACK=1).
        trim: takes the frames of whoever started the program (a fork server) off the
            top of every traceback, the full ones too.
    """

    def __init__(self, *, full: bool = False, trim: Trim | None = None) -> None:
        self.full = full
        self._trim = trim

    def __call__(
        self, kind: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        if self._trim is not None:
            tb = self._trim(tb)
        if self.full or not isinstance(exc, DsmlError | KeyboardInterrupt):
            sys.__excepthook__(kind, exc.with_traceback(tb), tb)  # shows exc's own traceback
            return
        if isinstance(exc, KeyboardInterrupt):
            text = interrupt_line(exc, tb)
        else:
            text = short_report(exc, tb)
        sys.stderr.write(text)
        sys.stderr.flush()

    def __repr__(self) -> str:
        return f"<ReportHook {'full tracebacks' if self.full else 'short reports'}>"


def install(environ: Mapping[str, str] | None = None, *, trim: Trim | None = None) -> bool:
    """Make `sys.excepthook` a `ReportHook`, unless the program has set a hook of its own
    (or this one is in place already); True if it was installed.

    `environ` (default: os.environ) says whether tracebacks are to be full.
    """
    if sys.excepthook is not sys.__excepthook__:
        return False
    sys.excepthook = ReportHook(full=full_traceback(environ), trim=trim)
    return True
