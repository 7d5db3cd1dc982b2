"""What a job prints, sent to its client line by line (daemon layer).

While a job runs, the daemon replaces `sys.stdout` and `sys.stderr` with `_Forward`
streams (`_forwarding`): each collects what is written, from any thread, and sends whole
lines to the job's client as JOB_OUTPUT messages from the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, TextIO

from ..wire import Kind
from .protocol import MAX_OUTPUT_CHARS
from .worker_jobs import _Job

if TYPE_CHECKING:
    from .worker import WorkerDaemon

__all__: list[str] = []


class _Forward:
    """A text stream that sends what a job writes to its client, line by line.

    Writes may come from any thread (the engine's pool); sending happens on the loop.
    """

    def __init__(self, daemon: WorkerDaemon, job: _Job, stream: str, original: TextIO) -> None:
        self._daemon = daemon
        self._job = job
        self._stream = stream
        self._original = original
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._scheduled = False
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.current_thread()
        self.encoding = "utf-8"
        self.errors = "replace"

    def write(self, text: str) -> int:
        with self._lock:
            self._pending.append(text)
            if "\n" not in text or self._scheduled:
                return len(text)
            self._scheduled = True
        with contextlib.suppress(RuntimeError):  # the loop is closing
            self._loop.call_soon_threadsafe(self.flush)
        return len(text)

    def flush(self) -> None:
        with self._lock:
            text = "".join(self._pending)
            self._pending.clear()
            self._scheduled = False
        if not text or self._job.client_gone:
            return
        if threading.current_thread() is not self._loop_thread:  # wait for the loop's turn
            with self._lock:
                self._pending.append(text)
            return
        for start in range(0, len(text), MAX_OUTPUT_CHARS):
            part = text[start : start + MAX_OUTPUT_CHARS]
            self._daemon._send(self._job, Kind.JOB_OUTPUT, {"stream": self._stream, "text": part})

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._original.fileno()


@contextlib.contextmanager
def _forwarding(daemon: WorkerDaemon, job: _Job) -> Iterator[None]:
    """Send what the job prints to its client while it runs."""
    out = _Forward(daemon, job, "stdout", sys.stdout)
    err = _Forward(daemon, job, "stderr", sys.stderr)
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
        out.flush()
        err.flush()
