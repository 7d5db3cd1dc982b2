"""Ctrl-C and notebook interrupts cancel a waiting `client.run` (daemon layer).

`asyncio.run` turns Ctrl-C into cancelling the main task, but a Jupyter kernel (ipykernel
up to 7.x at least) cannot interrupt a cell that awaits a coroutine: its SIGINT handler
asks the cell to stop, and that request is only seen once the coroutine has finished
(ipykernel issue 881), so a long job could not be stopped from the notebook at all. While
a `client.run` waits in the main thread, dsml's own SIGINT handler cancels the task that
called it; the job is then cancelled on every worker as for any cancellation. A second
SIGINT before that finished goes to the handler that was there before (the usual
KeyboardInterrupt), so there is always a way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

__all__ = ["interrupt_cancels"]

# Only the main thread touches these: it installs the handler, and Python runs signal
# handlers there (between two bytecodes), so no lock is needed (one could deadlock).
_waiting: dict[asyncio.Task[Any], bool] = {}  # task -> cancelled by a SIGINT already
_previous: Callable[[int, FrameType | None], Any] | int | None = None


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    fresh = [task for task, asked in list(_waiting.items()) if not asked and not task.done()]
    for task in fresh:
        _waiting[task] = True
        task.get_loop().call_soon_threadsafe(task.cancel)  # wakes the loop from its select
    if fresh:
        return
    if callable(_previous):
        _previous(signum, frame)
    elif _previous == signal.SIG_DFL:
        raise KeyboardInterrupt


@contextlib.contextmanager
def interrupt_cancels(task: asyncio.Task[Any] | None) -> Iterator[None]:
    """While inside, SIGINT cancels `task` (main thread only; else nothing changes)."""
    global _previous
    if task is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    current = signal.getsignal(signal.SIGINT)
    installed = current is _on_sigint
    if not installed and current not in (signal.SIG_IGN, None):  # None: not set from Python
        _previous = current  # what a second SIGINT, and the end of the last run, go back to
        signal.signal(signal.SIGINT, _on_sigint)
        installed = True
    if installed:
        _waiting[task] = False
    try:
        yield
    finally:
        _waiting.pop(task, None)
        # Put the previous handler back, unless someone replaced ours meanwhile.
        if not _waiting and signal.getsignal(signal.SIGINT) is _on_sigint:
            signal.signal(signal.SIGINT, _previous)
