"""An asyncio event loop on a thread of its own, and blocking ways into it (adapter layer).

`LoopThread` runs a loop on a daemon thread; code on other threads starts work there
(`start`, which returns a `Handle`), or starts it and waits (`run`, `call`). `Handle.wait`
blocks for the result; Ctrl-C while waiting cancels the work. Loop threads a program left
running are stopped at interpreter exit, while the interpreter is whole (`_stop_at_exit`).
The blocking API (blocking.py, which re-exports `Handle` and `LoopThread`) runs each
communicator on one, and so does the torch backend's hosted registry. Nothing here knows
about communicators.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

__all__ = ["Handle", "LoopThread", "wait_done"]

T = TypeVar("T")

#: how long a blocked wait sleeps at most before it lets Python run a signal handler
_SIGNAL_SLICE_S = 0.1


class Handle(Generic[T]):
    """An operation started on the communicator's loop; `wait()` gives its result."""

    __slots__ = ("_cancel", "_cancel_soon", "_future", "what")

    def __init__(
        self,
        future: concurrent.futures.Future[T],
        what: str,
        cancel: Callable[[], bool] | None = None,
        cancel_soon: Callable[[], None] | None = None,
    ) -> None:
        self._future = future
        self.what = what
        self._cancel = cancel  # what cancelling means, when more than giving up the wait
        self._cancel_soon = cancel_soon  # the same, asked without waiting for the loop

    def wait(self, timeout: float | None = None) -> T:
        """Block until the operation ends; return its result or raise its error.

        Args:
            timeout: seconds to wait (None: as long as it takes). Running out raises
                TimeoutError and leaves the operation running: wait again or `cancel()`.

        Ctrl-C (KeyboardInterrupt) while waiting cancels the operation, then re-raises.
        """
        try:
            wait_done(self._future, timeout)
            return self._future.result()
        except concurrent.futures.TimeoutError:
            if self._future.done():
                raise  # the operation itself raised a TimeoutError
            raise TimeoutError(
                f"{self.what} is still running after {timeout} s; wait() again or cancel() it"
            ) from None
        except KeyboardInterrupt:
            if self._cancel_soon is not None and not self._future.done():
                self._cancel_soon()  # do not wait for a busy loop to raise the interrupt
            else:
                self.cancel()
            raise

    def done(self) -> bool:
        """True once the operation has finished (succeeded, failed or been cancelled)."""
        return self._future.done()

    def cancel(self) -> bool:
        """Cancel the operation; the peers of a cancelled collective fail instead of waiting."""
        if self._cancel is not None and not self._future.done():
            return self._cancel()  # an engine op: cancelled in the engine, which ends it
        return self._future.cancel()

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "running"
        return f"<Handle {self.what} {state}>"


class LoopThread:
    """An asyncio event loop on a daemon thread, and blocking ways into it."""

    def __init__(self, name: str = "dsml-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        _live.add(self)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            if pending:
                gather = asyncio.gather(*pending, return_exceptions=True)
                self.loop.run_until_complete(gather)
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def start(
        self, awaitable: Awaitable[T], what: str, cancel: Callable[[], bool] | None = None
    ) -> Handle[T]:
        """Await `awaitable` on the loop; return its handle at once. `cancel`, called on
        the loop, replaces giving up the wait when the handle is cancelled (for an
        awaitable that cancelling its waiter does not cancel, as an engine op)."""
        coro = awaitable if isinstance(awaitable, Coroutine) else _outcome(awaitable)
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        if cancel is None:
            return Handle(future, what)

        def soon() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self.loop.call_soon_threadsafe(cancel)

        return Handle(future, what, lambda: self.call(cancel), soon)

    def run(self, awaitable: Awaitable[T], what: str) -> T:
        """Await `awaitable` on the loop and wait for it (Ctrl-C cancels it)."""
        return self.start(awaitable, what).wait()

    def call(self, fn: Callable[[], T]) -> T:
        """Call `fn()` on the loop's thread and return what it returns (at once when
        called there: waiting for the loop from its own thread would never end)."""
        if threading.current_thread() is self._thread:
            return fn()

        async def on_loop() -> T:
            return fn()

        return self.run(on_loop(), getattr(fn, "__name__", "call"))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the loop (tasks still running are cancelled) and join the thread."""
        _live.discard(self)
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)

    def __repr__(self) -> str:
        return f"<LoopThread {self._thread.name} {'running' if self.alive else 'stopped'}>"


async def _outcome(awaitable: Awaitable[T]) -> T:
    return await awaitable


#: loop threads not stopped yet: stopped at interpreter exit (see `_stop_at_exit`)
_live: weakref.WeakSet[LoopThread] = weakref.WeakSet()
_EXIT_JOIN_S = 5.0


@atexit.register
def _stop_at_exit() -> None:
    """Stop the loop threads a program left running (it exited without closing them).

    A daemon thread still running when the interpreter finalizes is killed the moment it
    next takes the GIL (`pthread_exit`); if that happens inside C++ (a torch future
    completed from the loop, say), the unwinding aborts the whole process with
    "terminate called without an active exception" (SIGABRT), e.g. a DDP script that
    returns after a peer was lost without `destroy_process_group()`. Stopping the loops
    here, while the interpreter is whole, ends their tasks (cancelled, as on `stop`) first.
    """
    for thread in list(_live):
        thread.stop(_EXIT_JOIN_S)


def wait_done(future: concurrent.futures.Future[Any], timeout: float | None) -> None:
    """Block until future is done, in slices of at most 0.1 s; TimeoutError if `timeout`
    seconds pass first.

    Any thread of a process may take a process-directed signal. A SIGINT taken by the loop
    thread (or another Python thread) sets Python's flag but does not wake the main
    thread's lock wait, so one long wait would raise KeyboardInterrupt only when the call
    ended by itself (seen as a Ctrl-C test hanging under load). Waking every slice lets
    the main thread run the handler within 0.1 s.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while not future.done():
        left = _SIGNAL_SLICE_S if deadline is None else deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        concurrent.futures.wait([future], timeout=min(left, _SIGNAL_SLICE_S))
