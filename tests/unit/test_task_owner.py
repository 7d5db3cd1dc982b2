"""The communicator's task owner: awaits every task on close, reports unexpected errors."""

from __future__ import annotations

import asyncio

from dsml.communicator.tasks import TaskOwner


async def test_closing_waits_for_running_tasks_then_cancels_the_rest():
    owner = TaskOwner()
    finished = asyncio.Event()

    async def short():
        await asyncio.sleep(0)
        finished.set()

    forever = owner.spawn(asyncio.Event().wait())
    owner.spawn(short())
    await owner.aclose(0.05)
    assert finished.is_set()
    assert forever.cancelled()
    assert len(owner) == 0


async def test_an_unexpected_error_in_a_watched_task_is_reported_once(caplog):
    owner = TaskOwner()
    seen: list[BaseException] = []
    owner.report_crashes(seen.append)

    async def bug():
        raise RuntimeError("a bug")

    async def expected():
        raise ValueError("the awaiter's business")

    owner.spawn(bug())
    unwatched = owner.spawn(expected(), watched=False)
    await owner.aclose(1.0)
    assert [str(e) for e in seen] == ["a bug"]
    assert "a background task of the communicator failed" in caplog.text
    assert isinstance(unwatched.exception(), ValueError)
