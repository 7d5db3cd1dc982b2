"""What every plan of one communicator shares (communicator layer).

`PlanState` holds the work-buffer pools, the remembered argument checks, the chunk size,
the placement, the `auto` chooser and the shared-memory hook, with the argument checks
and buffer helpers the plans (plain functions of it: plan_reductions.py,
plan_movement.py) use. The session makes one per communicator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ..collectives import ArrayBackend, BufferPool, backend_of, dtype_name
from ..collectives.cost_auto import AutoChooser
from ..errors import ConfigError
from .stats import timed

if TYPE_CHECKING:
    from .placement import Placement
    from .shm_hook import ShmHook

__all__ = ["PlanState"]

_MEMO_SIZE = 256  # remembered argument checks and fingerprints per communicator

Array = Any
T = TypeVar("T")


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
