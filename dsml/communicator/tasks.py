"""The one owner of a communicator's background tasks (communicator layer).

Every task a communicator starts (its calls, sends waiting for room, control messages,
calls waiting for a change of view) is spawned here. The owner outlives them all:
`aclose` waits for them (then cancels what is left and waits again), so nothing runs after
the communicator is closed. A task that ends with an exception nobody expected (a bug, not
a collective's own error, which its caller receives) is logged with its traceback and
reported to the function `report_crashes` names, which fails the communicator instead of
leaving a silent hang.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["TaskOwner"]

log = logging.getLogger("dsml.communicator")

T = TypeVar("T")


class TaskOwner:
    """Spawns, watches and finally awaits the tasks of one communicator."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        #: told about a watched task's unexpected exception (the communicator fails)
        self._on_crash: Callable[[BaseException], None] = lambda _exc: None
        self.closed = False

    def spawn(self, coro: Coroutine[Any, Any, T], *, watched: bool = True) -> asyncio.Task[T]:
        """Run `coro` as a task of this owner.

        With `watched`, an exception it ends with is a bug of dsml (logged, the
        communicator fails); without, its outcome is its awaiter's business (a call's task,
        whose error goes to the caller through its handle).
        """
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._reap if watched else self._tasks.discard)
        return task

    def _reap(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            log.error("a background task of the communicator failed", exc_info=error)
            self._on_crash(error)

    def report_crashes(self, to: Callable[[BaseException], None]) -> None:
        """Tell `to` (the root communicator's `RootLife.fail`) of a watched task's bug."""
        self._on_crash = to

    def __len__(self) -> int:
        return len(self._tasks)

    async def aclose(self, grace_s: float) -> None:
        """Wait up to `grace_s` for every task, then cancel the rest and wait for them."""
        self.closed = True
        while self._tasks:
            pending = set(self._tasks)
            _done, late = await asyncio.wait(pending, timeout=grace_s)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)
            grace_s = 0.0

    async def cancel_all(self) -> None:
        """Cancel every task now and wait until all have ended."""
        await self.aclose(0.0)

    def __repr__(self) -> str:
        return f"<TaskOwner tasks={len(self._tasks)}{' closed' if self.closed else ''}>"
