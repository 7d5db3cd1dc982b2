"""Awaitable handles returned by every collective call (communicator layer)."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

from ..errors import CollectiveAbortedError

#: the tasks of calls that comm.aclose() cancelled (not the caller): their handles raise
#: CollectiveAbortedError, not a CancelledError the awaiting task would take for its own
_closed_by_comm: weakref.WeakSet[asyncio.Future[Any]] = weakref.WeakSet()


def cancel_on_close(task: asyncio.Future[Any]) -> None:
    """Cancel a call's task because its communicator closes (a task the caller is already
    cancelling stays the caller's cancellation)."""
    if task.done():
        return
    if not isinstance(task, asyncio.Task) or task.cancelling() == 0:
        _closed_by_comm.add(task)
    task.cancel()


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


__all__ = ["CollectiveHandle"]

T = TypeVar("T")


class CollectiveHandle(Generic[T]):
    """A collective that has started; `await handle` gives its result.

    Cancelling the handle (or the task awaiting it) gives the call up here and tells the
    peers, which then fail with `CollectiveAbortedError` instead of waiting for this rank.
    A peer that had already received everything it needed keeps its result, so after a
    cancellation the ranks' copies of that data may differ; this rank's input is intact.
    """

    __slots__ = ("_task", "cid", "collective")

    def __init__(self, task: asyncio.Task[T], collective: str, cid: int) -> None:
        self._task = task
        self.collective = collective
        self.cid = cid

    def __await__(self) -> Generator[Any, None, T]:
        try:
            return (yield from self._task.__await__())
        except asyncio.CancelledError:
            self._raise_if_closed()
            raise

    def _raise_if_closed(self) -> None:
        closed = self._closed_error()
        if closed is not None:
            raise closed from None

    def _closed_error(self) -> CollectiveAbortedError | None:
        """The error of a call that comm.aclose() cancelled (None otherwise, and while the
        awaiting task is itself being cancelled: then its CancelledError goes on)."""
        if self._task not in _closed_by_comm or _cancelling():
            return None
        return CollectiveAbortedError(
            f"{self.collective} #{self.cid}: this communicator was closed while the call "
            "ran (the peers are told)",
            cid=self.cid,
            collective=self.collective,
        )

    def done(self) -> bool:
        return self._task.done()

    def cancelled(self) -> bool:
        return self._task.cancelled()

    def result(self) -> T:
        """The result; raises if the collective failed or is not done."""
        try:
            return self._task.result()
        except asyncio.CancelledError:
            self._raise_if_closed()
            raise

    def exception(self) -> BaseException | None:
        try:
            return self._task.exception()
        except asyncio.CancelledError:
            closed = self._closed_error()
            if closed is None:
                raise
            return closed

    def cancel(self, msg: str | None = None) -> bool:
        """Cancel here and abort the collective on the ranks still waiting for it."""
        return self._task.cancel(msg)

    def add_done_callback(self, fn: Callable[[CollectiveHandle[T]], object]) -> None:
        self._task.add_done_callback(lambda _task: fn(self))

    def __repr__(self) -> str:
        if not self._task.done():
            state = "running"
        elif self._task.cancelled():
            state = "cancelled"
        elif self._task.exception() is not None:
            state = f"failed: {type(self._task.exception()).__name__}"
        else:
            state = "done"
        return f"<CollectiveHandle {self.collective} #{self.cid} {state}>"
