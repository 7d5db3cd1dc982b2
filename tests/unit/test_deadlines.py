"""The runner's shared deadline timer for calls with the default budget (runner.Deadlines)."""

from __future__ import annotations

import asyncio

from dsml.communicator.call import DeadlinePassed
from dsml.communicator.runner import Deadlines


class FakeCall:
    """What Deadlines sees of a call: whether it is over, and `fail`."""

    def __init__(self, name: str, failed: list[str]) -> None:
        self.name = name
        self.over = False
        self._failed = failed

    def fail(self, error: BaseException) -> bool:
        assert isinstance(error, DeadlinePassed)
        self._failed.append(self.name)
        return True


async def test_every_call_still_running_at_its_deadline_fails_in_start_order():
    failed: list[str] = []
    deadlines = Deadlines(asyncio.get_running_loop(), 0.05)
    calls = [FakeCall(f"c{i}", failed) for i in range(5)]
    for call in calls:
        deadlines.add(call)
        await asyncio.sleep(0.005)  # deadlines 5 ms apart: the timer re-arms between them
    await asyncio.sleep(0.2)
    assert failed == ["c0", "c1", "c2", "c3", "c4"]
    deadlines.close()


async def test_a_call_that_ended_in_time_is_never_failed():
    failed: list[str] = []
    deadlines = Deadlines(asyncio.get_running_loop(), 0.05)
    first, second, third = (FakeCall(n, failed) for n in ("first", "second", "third"))
    for call in (first, second, third):
        deadlines.add(call)
    first.over = True
    deadlines.forget_over()
    third.over = True  # behind a running call: dropped when the timer reaches it
    await asyncio.sleep(0.2)
    assert failed == ["second"]
    assert "0 calls" in repr(deadlines)
    deadlines.close()


async def test_closing_stops_the_timer():
    failed: list[str] = []
    deadlines = Deadlines(asyncio.get_running_loop(), 0.02)
    deadlines.add(FakeCall("late", failed))
    deadlines.close()
    await asyncio.sleep(0.1)
    assert failed == []
