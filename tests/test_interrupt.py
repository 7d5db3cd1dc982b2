"""SIGINT (Ctrl-C, a notebook's interrupt) cancels a task waiting in `interrupt_cancels`."""

from __future__ import annotations

import asyncio
import os
import signal

from dsml.daemon.interrupt import interrupt_cancels
from tests.waiting import eventually


async def test_sigint_cancels_the_waiting_task_then_goes_to_the_previous_handler():
    seen: list[int] = []

    def previous(signum: int, frame: object) -> None:
        seen.append(signum)

    saved = signal.signal(signal.SIGINT, previous)
    try:
        second = asyncio.Event()
        outcome: list[str] = []

        async def waiter() -> None:
            with interrupt_cancels(asyncio.current_task()):
                assert signal.getsignal(signal.SIGINT) is not previous
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    outcome.append("cancelled")
                await second.wait()  # still inside: a second SIGINT is not ours to take

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)
        await eventually(lambda: outcome == ["cancelled"], "the cancel")
        assert seen == []  # the first one was taken
        os.kill(os.getpid(), signal.SIGINT)
        await eventually(lambda: seen == [signal.SIGINT], "the previous handler called")
        second.set()
        await task
        assert signal.getsignal(signal.SIGINT) is previous  # put back
    finally:
        signal.signal(signal.SIGINT, saved)


async def test_an_ignored_sigint_stays_ignored():
    saved = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupt_cancels(asyncio.current_task()):
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, saved)
