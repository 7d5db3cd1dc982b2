"""What a plan is made of: requests, plans, the plans' shared state (communicator layer).

`Request` is one collective call as the user made it, `Plan` a validated call (its
fingerprint and the coroutine that runs it over a `Call`). `PlanState` holds what every
plan of one communicator shares: the work-buffer pools, the remembered argument checks,
the chunk size, the placement, the `auto` chooser and the shared-memory hook, with the
argument checks and buffer helpers the plans use. The plans themselves are plain
functions of a `PlanState` (plan_reductions.py, plan_movement.py); `plan` (plans.py)
dispatches a request to them through one table.
"""

from __future__ import annotations

import operator
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ..collectives import ArrayBackend, BufferPool, backend_of, dtype_name
from ..collectives.cost_auto import AutoChooser
from ..errors import ConfigError
from ..wire import ROW_COLLECTIVES, Fingerprint
from .call import Call
from .stats import timed

if TYPE_CHECKING:
    from .placement import Placement
    from .shm_hook import ShmHook

__all__ = [
    "ROOTED",
    "SHM_ALGORITHMS",
    "Plan",
    "PlanState",
    "Request",
    "check_root",
    "loose_fingerprint",
    "rows_view",
]

SHM_ALGORITHMS = ("shm", "hierarchical")
_MEMO_SIZE = 256  # remembered argument checks and fingerprints per communicator

Array = Any
T = TypeVar("T")


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


class PlanState:
    """What every plan of one communicator shares (its only writer: the plan functions,
    through these methods); made once per communicator by its `Session`."""

    __slots__ = ("_memo", "_pools", "auto", "chunk", "placement", "shm")

    def __init__(
        self,
        chunk_bytes: int,
        placement: Placement,
        auto: AutoChooser | None = None,
        shm: ShmHook | None = None,
    ) -> None:
        self._pools: dict[str, BufferPool] = {}
        self.chunk = chunk_bytes  # in every fingerprint: ranks must cut messages alike
        self.placement = placement
        self.auto = auto  # what `auto` runs across hosts (None: the size table)
        self.shm = shm  # the same-host shared-memory plane (shm_hook.py)
        #: what the checks of repeated arguments gave (a training loop repeats a few)
        self._memo: dict[Any, Any] = {}

    def memo_get(self, key: Any, make: Callable[[], T]) -> T:
        """make(), remembered under `key`: for pure checks and fingerprints, whose result
        depends on the key alone. An unhashable key (an odd op) is simply not kept."""
        try:
            return self._memo[key]  # type: ignore[no-any-return]
        except KeyError:
            pass
        except TypeError:
            return make()
        value = make()  # raises for invalid arguments: errors are not kept
        if len(self._memo) >= _MEMO_SIZE:
            self._memo.clear()
        self._memo[key] = value
        return value

    def pool(self, be: ArrayBackend) -> BufferPool:
        """The work-buffer pool of this backend's arrays."""
        if be.name not in self._pools:
            self._pools[be.name] = BufferPool(be)
        return self._pools[be.name]

    # -- argument checks --------------------------------------------------------------------

    def array(
        self, x: object, what: str = "x", *, writable: bool = False
    ) -> tuple[Array, ArrayBackend, str]:
        """(x as a plain array sharing its memory, its backend, its dtype's wire name)."""
        be = timed(backend_of(x, what))  # reductions and copies count in comm.stats()
        dtype = x.dtype  # type: ignore[attr-defined]
        name: str = self.memo_get(("dtype", dtype), lambda: dtype_name(dtype))
        if writable:
            if not getattr(x.flags, "writeable", True):  # type: ignore[attr-defined]
                raise ConfigError(
                    f"{what} is read-only, but this collective writes its result into it"
                )
            strides, shape = getattr(x, "strides", ()), getattr(x, "shape", ())
            if (
                0 in strides
                and 0 not in shape
                and any(  # (empty arrays have 0 strides)
                    not s and n > 1 for s, n in zip(strides, shape, strict=True)
                )
            ):
                raise ConfigError(
                    f"{what} has elements that share memory (a stride of 0: a broadcast or "
                    "expanded view), but this collective writes its result into it; pass a "
                    "copy"
                )
        return be.plain(x), be, name

    def flat_input(self, be: ArrayBackend, x: Array) -> tuple[Array, Array | None]:
        """A flat contiguous view of x, or a pooled copy (returned second, to release)."""
        view = be.flat_view(x)
        if view is not None:
            return view, None
        buf = self.pool(be).acquire(x.size, x.dtype.newbyteorder("="))
        be.copy_flat(x, buf)
        return buf, buf

    def release(self, be: ArrayBackend, *bufs: Array | None) -> None:
        for buf in bufs:
            if buf is not None:
                self.pool(be).release(buf)

    def __repr__(self) -> str:
        return (
            f"<PlanState chunk_bytes={self.chunk} pools={sorted(self._pools)} "
            f"memo={len(self._memo)} auto={self.auto is not None} shm={self.shm is not None}>"
        )
