"""Child-process helpers shared by the launcher and LocalCluster (leaf module)."""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys
from collections.abc import Callable

__all__ = ["describe_exit", "die_with_parent"]


def _set_parent_death_signal() -> None:  # pragma: no cover - runs in the child before exec
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


#: `preexec_fn` that makes a child get SIGKILL when its parent dies (Linux; else None).
die_with_parent: Callable[[], None] | None = (
    _set_parent_death_signal if sys.platform == "linux" else None
)


def describe_exit(code: int) -> str:
    """`exit code 3` or `killed by SIGKILL` for a process's return code."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
