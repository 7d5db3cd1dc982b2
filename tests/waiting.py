"""Waiting on state that has no event (counters, registry tables) in tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable


async def eventually(predicate: Callable[[], bool], what: str, within: float = 2.0) -> None:
    """Poll until predicate() holds (for counters, which have no event to wait on)."""
    try:
        async with asyncio.timeout(within):
            while not predicate():  # noqa: ASYNC110 (no event to wait on)
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"not within {within} s: {what}") from None


class LoopLag:
    """How long this event loop could not run what was due, over a block of a test.

    A ticker asks to run every `tick` s and adds up how late each wake-up came. On a
    loaded machine (another job on every core) the loop of an in-process cluster is
    descheduled or queued behind its own work for whole tenths of a second; that time
    is the machine's, not dsml's. A test that bounds how long dsml took to notice
    something (detection within the heartbeat timeout) bounds `elapsed - lag.late`:

        async with LoopLag() as lag:
            ...
        assert lag.net(took) < bound
    """

    def __init__(self, tick: float = 0.01) -> None:
        self.tick = tick
        self.late = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.tick
            await asyncio.sleep(self.tick)
            self.late += max(0.0, loop.time() - due)

    def net(self, elapsed: float) -> float:
        """elapsed less the time the loop was held up (never below 0)."""
        return max(0.0, elapsed - self.late)

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.ensure_future(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
