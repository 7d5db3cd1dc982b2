"""Fixtures of the engine tests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest

from dsml.engine import Engine, SerialEngine

TIMEOUT = 10.0


def _pool_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"dsml-{name}")]


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    """A threaded engine with four pool threads; the test fails if it leaves threads behind."""
    eng = Engine(max_workers=4, name="test-engine")
    yield eng
    await asyncio.wait_for(eng.aclose(cancel=True), TIMEOUT)  # a bug fails, never hangs
    assert _pool_threads("test-engine") == [], "aclose() left pool threads running"


@pytest.fixture(params=["threaded", "serial"])
async def any_engine(request: pytest.FixtureRequest) -> AsyncIterator[Engine | SerialEngine]:
    """Each semantics test runs on the threaded engine and on the serial reference."""
    eng: Engine | SerialEngine
    eng = Engine(max_workers=4, name="any") if request.param == "threaded" else SerialEngine()
    yield eng
    await asyncio.wait_for(eng.aclose(cancel=True), TIMEOUT)
