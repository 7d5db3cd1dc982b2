"""torch `Work` objects for operations running on a dsml communicator (adapter layer)."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..blocking_loop import wait_done

__all__ = ["DsmlWork", "RunState", "backend_error", "cause_of"]

#: after a wait() that timed out cancels its call, how long it waits for the call to end
_CANCEL_GRACE_S = 10.0


@dataclass
class RunState:
    """Whether a call started on the loop thread, and when it ended (set from there);
    a receive's source rank (-1 until known, as torch's Work has it)."""

    started: bool = False
    ended: threading.Event = field(default_factory=threading.Event)
    source: int = -1


# The latest failures, for `cause_of`: DDP's reducer re-raises them through C++, which
# keeps the message but drops the Python exception and its chain.
_recent: collections.deque[BaseException] = collections.deque(maxlen=32)


def cause_of(error: BaseException) -> BaseException | None:
    """The dsml error behind a torch error raised by this backend, or None.

    Follows the exception chain (`DistBackendError` from `work.wait()` or a collective
    call); for a RuntimeError that torch's C++ re-raised (DDP's backward), finds the
    recent dsml failure whose message it carries.
    """
    seen: BaseException | None = error
    while seen is not None:
        if type(seen).__module__.startswith("dsml."):
            return seen
        seen = seen.__cause__ or seen.__context__
    text = str(error)
    return next((e for e in reversed(_recent) if str(e) and str(e) in text), None)


def backend_error(what: str, error: BaseException) -> dist.DistBackendError:
    """torch's error for a failed backend call, with dsml's error as its cause."""
    if isinstance(error, concurrent.futures.CancelledError):
        text = f"dsml {what} was cancelled"
    elif isinstance(error, TimeoutError):  # "Timed out" as gloo and NCCL say, which code matches
        text = f"dsml {what} failed: Timed out ({type(error).__name__}: {error})"
    else:
        text = f"dsml {what} failed: {type(error).__name__}: {error}"
    wrapped = dist.DistBackendError(text)
    wrapped.__cause__ = error
    _recent.append(error)
    return wrapped


class DsmlWork(dist._Work):  # type: ignore[misc]
    """One torch.distributed call in flight on dsml's loop thread.

    `wait()` blocks until it ends and raises `DistBackendError` (caused by dsml's error)
    if it failed; `get_future()` gives a torch Future completed with the call's result
    (the output tensors), or with that error.
    """

    def __init__(
        self, future: concurrent.futures.Future[Any], what: str, state: RunState | None = None
    ) -> None:
        super().__init__()
        self._future = future
        self._what = what
        self._state = state
        # torch's Future.set_exception stores the exception as a *value*, which C++
        # consumers (DDP's reducer) read as a result; an exception raised in a `then`
        # callback is a real error for them. So `_done` only signals the end, and the
        # future handed out returns the result or raises from its callback.
        self._done: torch.futures.Future[None] = torch.futures.Future()
        self._torch_future = self._done.then(self._outcome)
        future.add_done_callback(lambda _f: self._done.set_result(None))  # loop thread

    def _outcome(self, _done: torch.futures.Future[None]) -> Any:
        error = self._error()
        if error is not None:
            raise error
        return self._future.result()

    def _error(self) -> dist.DistBackendError | None:
        if self._future.cancelled():
            return backend_error(self._what, concurrent.futures.CancelledError())
        error = self._future.exception()
        return None if error is None else backend_error(self._what, error)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the call ends; raise DistBackendError if it failed. A `timeout`
        that runs out cancels the call (as gloo gives its pair up): its tensors are left
        as they were, the other ranks' matching call fails too, and the error says so.
        Left running, it would have written the tensors after wait() had raised."""
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        try:  # in slices, so a Ctrl-C that another thread took still raises here
            wait_done(self._future, seconds if seconds > 0 else None)
        except TimeoutError:
            self._cancel()
            raise dist.DistBackendError(
                f"dsml {self._what}: Timed out waiting {seconds * 1000:.0f}ms for it to "
                "finish, so it was cancelled: its tensors are as they were, and the other "
                "ranks' matching call fails too"
            ) from None
        self._settle()
        error = self._error()
        if error is not None:
            raise error
        return True

    def _cancel(self) -> None:
        """Cancel the call and wait (bounded) until it has ended on the loop thread, having
        put back what it wrote."""
        self._future.cancel()
        state = self._state
        if state is not None and state.started:
            state.ended.wait(_CANCEL_GRACE_S)

    def _settle(self) -> None:
        """Wait for the torch future too: the loop thread completes it just after the call
        ends, so right after wait() it was often still pending (and value() asserted)."""
        with contextlib.suppress(Exception):  # its error is the call's: _error() has it
            self._torch_future.wait()

    def _source_rank(self) -> int:
        """The rank a receive got its message from (recv from any source too)."""
        return self._state.source if self._state is not None else -1

    source_rank = _source_rank

    def get_future(self) -> torch.futures.Future[Any]:
        return self._torch_future

    def is_completed(self) -> bool:
        return bool(self._torch_future.done())  # done only once the call has ended

    def is_success(self) -> bool:
        return self.is_completed() and self._error() is None

    def exception(self) -> BaseException | None:
        return self._error() if self.is_completed() else None

    def __repr__(self) -> str:
        return f"<DsmlWork {self._what} {'done' if self._future.done() else 'running'}>"
