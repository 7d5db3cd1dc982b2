"""The fake cupy of tests/fakes, as the `fake_cupy` fixture (in conftest.py) uses it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import dsml.collectives

FAKES = Path(__file__).resolve().parent / "fakes"


def _forget_cupy() -> dict[str, Any]:
    names = [
        n for n in sys.modules if n in ("cupy", "dsml.collectives.cuda") or n.startswith("cupy.")
    ]
    return {name: sys.modules.pop(name) for name in names}


def use_fake_cupy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """`import cupy` gives the fake, and dsml's CUDA module is loaded against it (undone
    afterwards, so a real cupy, where there is one, is untouched)."""
    saved = _forget_cupy()
    monkeypatch.delattr(dsml.collectives, "cuda", raising=False)
    monkeypatch.syspath_prepend(str(FAKES))
    import cupy

    cupy.LOG.clear()
    try:
        yield cupy
    finally:
        _forget_cupy()
        if hasattr(dsml.collectives, "cuda"):
            delattr(dsml.collectives, "cuda")
        sys.modules.update(saved)
