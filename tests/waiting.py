"""Waiting on state that has no event (counters, registry tables) in tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def eventually(predicate: Callable[[], bool], what: str, within: float = 2.0) -> None:
    """Poll until predicate() holds (for counters, which have no event to wait on)."""
    try:
        async with asyncio.timeout(within):
            while not predicate():  # noqa: ASYNC110 (no event to wait on)
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"not within {within} s: {what}") from None
