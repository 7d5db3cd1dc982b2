"""What a plan is made of: requests, plans, argument checks (communicator layer).

`Request` is one collective call as the user made it, `Plan` a validated call (its
fingerprint and the coroutine that runs it over a `Call`), with the argument checks that
need no state. What the plans of one communicator share is a `PlanState`
(plan_state.py); the plans themselves are plain functions of it (plan_reductions.py,
plan_movement.py), and `plan` (plans.py) dispatches a request to them through one table.
"""

from __future__ import annotations

import operator
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..wire import ROW_COLLECTIVES, Fingerprint
from .call import Call

__all__ = [
    "ROOTED",
    "SHM_ALGORITHMS",
    "Plan",
    "Request",
    "check_root",
    "loose_fingerprint",
    "rows_view",
]

SHM_ALGORITHMS = ("shm", "hierarchical")

Array = Any


def as_int(value: object) -> int | None:
    """An integer argument (a rank, a tag) as an int, numpy integers included; None for
    anything else (bool and float too)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


@dataclass(frozen=True, slots=True)
class Plan:
    """A validated call: its fingerprint, and the coroutine that runs it over a `Call`;
    `nbytes`, this rank's input size where the fingerprint does not give it (collectives
    whose first axis may differ between ranks: `comm.stats()` reports it)."""

    fingerprint: Fingerprint
    body: Callable[[Call], Awaitable[Any]]
    nbytes: int | None = None


#: collectives that name a root rank
ROOTED = frozenset({"reduce", "broadcast", "gather", "scatter"})


@dataclass(frozen=True, slots=True)
class Request:
    """One collective call as the user made it, before any check (see `plans.plan`).

    This is where the caller's arrays enter the communicator: `x` is exactly what the
    public method received (adapters convert before they build a request).
    """

    collective: str
    x: Any = None
    op: Any = None
    root: Any = None
    algorithm: Any = "auto"
    timeout: float | None = None
    caller: Any = None  # the calling thread's CUDA stream, for a cupy x

    def loose_fingerprint(self) -> Fingerprint:
        """A best-effort fingerprint of possibly invalid arguments, sent with the abort
        they cause (see `loose_fingerprint`)."""
        return loose_fingerprint(self.collective, self.x, self.op, self.root)


def loose_fingerprint(
    collective: str, x: object = None, op: object = None, root: object = None
) -> Fingerprint:
    """A best-effort fingerprint of invalid arguments, sent with the abort they cause.

    Only values the wire accepts are kept (short names, integers in range), so the abort
    is not itself refused as malformed by the peers.
    """
    try:
        dtype, shape = getattr(x, "dtype", None), getattr(x, "shape", None)
    except Exception:  # a released memoryview raises even for these
        dtype = shape = None
    if not (isinstance(shape, tuple) and len(shape) <= 64 and all(_valid_int(d) for d in shape)):
        shape = None
    elif collective in ROW_COLLECTIVES:  # their fingerprints hold a row's shape
        shape = shape[1:] if shape else None
    return Fingerprint(
        collective,
        dtype=_short_name(dtype),
        shape=shape,
        op=_short_name(getattr(op, "value", op)),
        root=root if type(root) is int and _valid_int(root) else None,
    )


def _short_name(value: object) -> str | None:
    text = str(value) if value is not None else ""
    return text if 0 < len(text) <= 64 else None


def _valid_int(value: object) -> bool:
    return type(value) is int and 0 <= value < 1 << 63


def rows_view(x: Array) -> Array:
    """x with at least one axis (a 0-d array counts as shape (1,))."""
    return x.reshape(1) if x.ndim == 0 else x


def check_root(root: object, size: int) -> int:
    """`root` as a rank of a group of `size`; `ConfigError` otherwise."""
    value = as_int(root)
    if value is None or not 0 <= value < size:
        raise ConfigError(f"root={root!r} is not a rank of this group of {size} (0..{size - 1})")
    return value
