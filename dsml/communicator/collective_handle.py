"""Awaitable handles returned by every collective call (communicator layer)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

from ..errors import CollectiveAbortedError

#: the message a call's task is cancelled with when its communicator closes
CLOSED_WHILE_RUNNING = "the communicator was closed while the call ran"


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
        except asyncio.CancelledError as exc:
            # Cancelled by comm.aclose() (not by the caller, nor its own task being
            # cancelled): a typed error, not a CancelledError the awaiting task would
            # pass for its own cancellation.
            if exc.args[:1] != (CLOSED_WHILE_RUNNING,) or _cancelling():
                raise
            raise CollectiveAbortedError(
                f"{self.collective} #{self.cid}: this communicator was closed while the "
                "call ran (the peers are told)",
                cid=self.cid,
                collective=self.collective,
            ) from None

    def done(self) -> bool:
        return self._task.done()

    def cancelled(self) -> bool:
        return self._task.cancelled()

    def result(self) -> T:
        """The result; raises if the collective failed or is not done."""
        return self._task.result()

    def exception(self) -> BaseException | None:
        return self._task.exception()

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
