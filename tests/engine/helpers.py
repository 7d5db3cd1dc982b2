"""Helpers shared by the engine tests (not a test module)."""

from __future__ import annotations

import asyncio
import threading

from dsml.engine import Engine, SerialEngine

TIMEOUT = 5.0  # generous: only a bug makes a handshake wait this long

AnyEngine = Engine | SerialEngine


async def until(event: asyncio.Event) -> None:
    """Wait for `event`, failing (not hanging) if it never comes."""
    await asyncio.wait_for(event.wait(), TIMEOUT)


def thread_until(event: threading.Event) -> bool:
    """Wait for `event` in a pool thread; False if it never came."""
    return event.wait(TIMEOUT)


async def settle(engine: Engine) -> None:
    """Run an independent plain op and an independent coroutine op to completion.

    Ops pushed before them that were free to start have started by then, so a test can
    check that an op which must wait is still pending without sleeping.
    """

    async def marker() -> None:
        await asyncio.sleep(0)

    await engine.push(lambda: None, name="settle-pool")
    await engine.push(marker, name="settle-loop")
