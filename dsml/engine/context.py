"""Which engine op is running in the current context (engine layer).

While an op's function runs (on the loop, or in a pool thread) and while the awaitable it
returned is awaited, `current_op()` returns that op. Code the op calls can thus tell
whether it runs inside the engine and which vars the op mutates: the communicator uses it
to keep collectives in one order on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .handle import OpHandle

__all__ = ["current_op", "running"]

_RUNNING: ContextVar[OpHandle[Any] | None] = ContextVar("dsml_engine_op", default=None)


def current_op() -> OpHandle[Any] | None:
    """The engine op whose function (or awaitable) is running here, or None."""
    return _RUNNING.get()


@contextlib.contextmanager
def running(op: OpHandle[Any]) -> Iterator[None]:
    """Mark `op` as the running op for what runs (or is created) inside the block."""
    token = _RUNNING.set(op)
    try:
        yield
    finally:
        _RUNNING.reset(token)
