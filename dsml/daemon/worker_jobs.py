"""One job on a worker daemon: its record, its report, its end (daemon layer).

`_Job` is the daemon's record of a job it runs (or holds until the previous one ended).
When a job ends, its report to the client is built here: the result's frames, checked
against the frame limit, or the failure with the user's part of the traceback (the
daemon's own frames dropped). Ending a job means closing its communicator to the end
even if the job is cancelled meanwhile (`_close_fully`), and, on rank 0, closing the
job's registry once the other ranks have left it (`_close_job_registry`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import traceback
from collections.abc import Sequence
from typing import Any

from ..communicator import Communicator
from ..membership.registry import Registry
from .protocol import JobSpec

__all__: list[str] = []

log = logging.getLogger("dsml.worker")

_HERE = os.path.dirname(os.path.abspath(__file__))
_LEAVE_WAIT_S = 3.0  # rank 0 keeps the job's registry until the others left, this long


@dataclasses.dataclass(slots=True)
class _Job:
    spec: JobSpec
    client: bytes
    frames: list[memoryview]
    task: asyncio.Task[None] | None = None
    cancelled: bool = False
    reported: bool = False  # its JOB_RESULT was sent
    client_gone: bool = False
    started: float = dataclasses.field(default_factory=time.monotonic)
    failure: BaseException | None = None  # what fn raised, kept while the job cleans up


async def _close_fully(comm: Communicator, *, error: Exception | None, cancel: bool) -> None:
    """Close a job's communicator to the end, even if the job is cancelled meanwhile.

    A failed job is often cancelled while it closes (the client cancels the other ranks
    as soon as the first one reports); cut short, the close would leave the communicator's
    sockets, heartbeat thread and shared-memory mappings behind in this long-lived
    process, a few with every such job. The close is bounded (its waits have timeouts),
    so the cancellation is honoured (re-raised) right after it.
    """
    closing = asyncio.ensure_future(comm.aclose(error=error, cancel=cancel))
    cancelled = False
    while not closing.done():
        try:
            await asyncio.shield(closing)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        if not closing.cancelled() and closing.exception() is not None:
            log.debug("closing a cancelled job's communicator failed", exc_info=closing.exception())
        raise asyncio.CancelledError
    closing.result()


def _check_sizes(frames: Sequence[Any], limit: int) -> None:
    for frame in frames:
        if memoryview(frame).nbytes > limit:
            raise ValueError(
                f"a result array of {memoryview(frame).nbytes:,} bytes is over the "
                f"{limit:,}-byte limit of one job frame: return it in parts"
            )


def _failure(error_type: str, message: str, trace: str = "") -> dict[str, Any]:
    return {"ok": False, "error_type": error_type, "message": message, "traceback": trace}


def _failure_of(exc: BaseException) -> dict[str, Any]:
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_HERE):
        tb = tb.tb_next  # the daemon's own frames say nothing about the user's error
    trace = "".join(traceback.format_exception(type(exc), exc, tb))
    if len(trace) > 32_000:
        trace = trace[:4_000] + "\n[... traceback shortened ...]\n" + trace[-28_000:]
    kind = type(exc)
    name = kind.__qualname__
    if kind.__module__ != "builtins":
        name = f"{kind.__module__}.{name}"
    return _failure(name, str(exc)[:4_000], trace)


async def _close_job_registry(registry: Registry) -> None:
    """Close the job's registry once its members have left (or after a short wait)."""
    deadline = time.monotonic() + _LEAVE_WAIT_S
    while registry.view is not None and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    await registry.aclose()
