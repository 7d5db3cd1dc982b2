"""Running an algorithm's data phase and its agreement lane together (collectives layer)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["together"]

T = TypeVar("T")


async def together(main: Coroutine[Any, Any, T], beside: Coroutine[Any, Any, Any]) -> T:
    """Run both; the first failure cancels the other and is raised as itself.

    (`asyncio.gather` would leave the other running after a failure; a `TaskGroup` alone
    would wrap the error in an ExceptionGroup, which callers do not expect.)
    """
    try:
        async with asyncio.TaskGroup() as group:
            result = group.create_task(main)
            group.create_task(beside)
    except BaseExceptionGroup as failures:
        task = asyncio.current_task()
        if task is not None and task.cancelling():  # our own cancellation comes first
            raise asyncio.CancelledError from None
        raise failures.exceptions[0] from None
    return result.result()
