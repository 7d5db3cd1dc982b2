"""Shared fixtures: every test must leave no dsml socket and no task behind."""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from dsml.transport import live_sockets
from tests.gpu_fakes import use_fake_cupy


def pytest_report_header(config: pytest.Config) -> str:
    return f"dsml tests: seed {_SEED} (set DSML_TEST_SEED to reproduce)"


_SEED = int(os.environ.get("DSML_TEST_SEED", random.SystemRandom().randrange(1 << 30)))


@pytest.fixture
def seed() -> int:
    """A per-run seed, printed in the header so a failure can be replayed."""
    print(f"seed={_SEED}")
    return _SEED


@pytest.fixture(autouse=True)
async def no_leaks():
    """Fail the test if it leaves sockets open or tasks running in its event loop."""
    sockets_before = live_sockets()
    tasks_before = set(asyncio.all_tasks())
    yield
    for _ in range(20):  # let closing tasks finish their last step
        await asyncio.sleep(0)
    leftover = [
        t
        for t in asyncio.all_tasks()
        if t not in tasks_before and t is not asyncio.current_task() and not t.done()
    ]
    assert not leftover, f"tasks left running: {leftover}"
    assert live_sockets() == sockets_before, (
        f"{live_sockets() - sockets_before} dsml sockets left open"
    )


@pytest.fixture
def fake_cupy(monkeypatch):
    """`import cupy` gives tests/fakes/cupy (numpy underneath) for the test's duration."""
    yield from use_fake_cupy(monkeypatch)
