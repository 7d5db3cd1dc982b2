"""torch `Work` objects for operations running on a dsml communicator (adapter layer)."""

from __future__ import annotations

import concurrent.futures
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DsmlWork", "backend_error"]


def backend_error(what: str, error: BaseException) -> dist.DistBackendError:
    """torch's error for a failed backend call, with dsml's error as its cause."""
    if isinstance(error, concurrent.futures.CancelledError):
        text = f"dsml {what} was cancelled"
    else:
        text = f"dsml {what} failed: {type(error).__name__}: {error}"
    wrapped = dist.DistBackendError(text)
    wrapped.__cause__ = error
    return wrapped


class DsmlWork(dist._Work):  # type: ignore[misc]
    """One torch.distributed call in flight on dsml's loop thread.

    `wait()` blocks until it ends and raises `DistBackendError` (caused by dsml's error)
    if it failed; `get_future()` gives a torch Future completed with the call's result
    (the output tensors), or with that error.
    """

    def __init__(self, future: concurrent.futures.Future[Any], what: str) -> None:
        super().__init__()
        self._future = future
        self._what = what
        self._torch_future: torch.futures.Future[Any] = torch.futures.Future()
        future.add_done_callback(self._deliver)  # on the loop thread, or now if done

    def _deliver(self, future: concurrent.futures.Future[Any]) -> None:
        error = self._error()
        if error is not None:
            self._torch_future.set_exception(error)
        else:
            self._torch_future.set_result(future.result())

    def _error(self) -> dist.DistBackendError | None:
        if self._future.cancelled():
            return backend_error(self._what, concurrent.futures.CancelledError())
        error = self._future.exception()
        return None if error is None else backend_error(self._what, error)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the call ends; raise DistBackendError if it failed."""
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        try:
            self._future.exception(seconds if seconds > 0 else None)
        except TimeoutError:
            raise dist.DistBackendError(
                f"dsml {self._what} did not finish within {seconds} s"
            ) from None
        error = self._error()
        if error is not None:
            raise error
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._torch_future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self._error() is None

    def exception(self) -> BaseException | None:
        return self._error() if self._future.done() else None

    def __repr__(self) -> str:
        return f"<DsmlWork {self._what} {'done' if self._future.done() else 'running'}>"
