"""Awaitable handles returned by every collective call (communicator layer)."""

from __future__ import annotations

import asyncio
import contextvars
import sys
import warnings
import weakref
from collections.abc import Callable, Generator
from pathlib import Path
from types import CodeType
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


__all__ = ["CollectiveHandle", "Unclaimed", "call_site", "caller_site"]

T = TypeVar("T")

#: a communicator's handles nobody took the result of yet, by id (weak references, plain
#: dict: cheaper per call than a WeakSet; a handle leaves it when claimed or collected)
Unclaimed = dict[int, "weakref.ref[CollectiveHandle[Any]]"]

_PACKAGE = str(Path(__file__).resolve().parents[1])  # .../dsml: frames there are ours

#: where a call handed over from another thread was made (set by `Runner.on_loop`, whose
#: start runs on the loop thread, far from the caller's frames)
call_site: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar(
    "dsml_call_site", default=None
)


#: code objects known to be dsml's own (skipped) or not (where the walk stops): a set
#: lookup per frame instead of a string comparison (this runs on every call)
_OURS: set[CodeType] = set()
_THEIRS: set[CodeType] = set()
_MAX_THEIRS = 4096  # code made anew per notebook cell: forget rather than grow


def caller_site(depth: int = 2) -> tuple[str, int]:
    """(file, line) of the first frame outside dsml above the caller: where the user made
    the call. A walk of a few frames, no traceback: cheap enough for every call."""
    frame: Any = sys._getframe(depth)
    while frame is not None:
        code = frame.f_code
        if code in _THEIRS:
            break
        if code not in _OURS:
            if not code.co_filename.startswith(_PACKAGE):
                if len(_THEIRS) >= _MAX_THEIRS:
                    _THEIRS.clear()
                _THEIRS.add(code)
                break
            _OURS.add(code)
        frame = frame.f_back
    if frame is None:
        return ("<unknown>", 0)
    return frame.f_code.co_filename, frame.f_lineno


class CollectiveHandle(Generic[T]):
    """A collective that has started; `await handle` gives its result.

    Cancelling the handle (or the task awaiting it) gives the call up here and tells the
    peers, which then fail with `CollectiveAbortedError` instead of waiting for this rank.
    A peer that had already received everything it needed keeps its result, so after a
    cancellation the ranks' copies of that data may differ; this rank's input is intact.
    """

    __slots__ = (
        "__weakref__",
        "_claimed",
        "_give_back",
        "_given_back",
        "_site",
        "_task",
        "_unclaimed",
        "cid",
        "collective",
    )

    def __init__(
        self,
        task: asyncio.Task[T],
        collective: str,
        cid: int,
        unclaimed: Unclaimed | None = None,
        *,
        give_back: Callable[[], bool] | None = None,
    ) -> None:
        self._task = task
        #: a receive's: returns its message to the stream if the await is cancelled after
        #: the task took it (the result would be lost with the cancelled awaiter)
        self._give_back = give_back
        self._given_back = False
        self.collective = collective
        self.cid = cid
        #: awaited, its result or exception asked for, or cancelled: not "never awaited"
        self._claimed = False
        self._site = call_site.get() or caller_site()
        self._unclaimed = unclaimed  # the communicator's, named when it closes
        if unclaimed is not None:
            unclaimed[id(self)] = weakref.ref(self)

    @property
    def site(self) -> str:
        """Where the call was made ("file:line", the first frame outside dsml)."""
        return f"{self._site[0]}:{self._site[1]}"

    def describe(self) -> str:
        """The call and where it was made, for warnings: "all_reduce #3 (train.py:12)"."""
        return f"{self.collective} #{self.cid} (made at {self.site})"

    def claim(self) -> None:
        """Say the result is taken care of: awaited here, or by whoever this handle is
        handed to (an engine op). Every way of taking the result calls it."""
        if not self._claimed:
            self._claimed = True
            if self._unclaimed is not None:
                self._unclaimed.pop(id(self), None)

    def __del__(self) -> None:
        # As asyncio warns of a coroutine never awaited: a forgotten `await` would leave
        # the array written at some later, unpredictable point, with no other sign.
        if self._claimed:
            return
        if self._unclaimed is not None:
            self._unclaimed.pop(id(self), None)  # before its id can be reused
        if self._task.cancelled():
            return
        warnings.warn(
            f"dsml collective {self.describe()} was never awaited: its result (the array "
            "it writes) lands at an unpredictable point; await the handle (or cancel it)",
            RuntimeWarning,
            stacklevel=2,
        )

    def __await__(self) -> Generator[Any, None, T]:
        self.claim()
        try:
            result = yield from self._task.__await__()
        except asyncio.CancelledError:
            self._raise_if_closed()
            task = self._task
            ended = task.done() and not task.cancelled() and task.exception() is None
            if self._give_back is not None and ended:
                # The task ended with a message in the turn this await was cancelled.
                self._given_back = self._given_back or self._give_back()
            raise
        if self._given_back:  # a cancelled await of this handle gave the message back
            raise asyncio.CancelledError("this receive's message went back to its stream")
        return result

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
        self.claim()
        if self._given_back:
            raise asyncio.CancelledError("this receive's message went back to its stream")
        try:
            return self._task.result()
        except asyncio.CancelledError:
            self._raise_if_closed()
            raise

    def exception(self) -> BaseException | None:
        self.claim()
        try:
            return self._task.exception()
        except asyncio.CancelledError:
            closed = self._closed_error()
            if closed is None:
                raise
            return closed

    def cancel(self, msg: str | None = None) -> bool:
        """Cancel here and abort the collective on the ranks still waiting for it."""
        self.claim()
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
