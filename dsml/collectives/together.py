"""Running an algorithm's data phase and its agreement lane together (collectives layer)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["together"]

T = TypeVar("T")


async def together(main: Coroutine[Any, Any, T], beside: Coroutine[Any, Any, Any]) -> T:
    """Run both; the first failure stops the other and is raised as itself.

    Both run as tasks owned by this coroutine: neither outlives it, whatever happens.
    (`asyncio.gather` would leave the other running after a failure; a `TaskGroup` would
    wrap the error in an ExceptionGroup, and on Python 3.11 leaves the awaiting task
    marked as cancelling after a child failed.)
    """
    tasks = [asyncio.ensure_future(main), asyncio.ensure_future(beside)]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:  # stop whichever is still running (ours to stop), then wait
            task.cancel()
        await asyncio.wait(tasks)
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    return tasks[0].result()  # type: ignore[no-any-return]
