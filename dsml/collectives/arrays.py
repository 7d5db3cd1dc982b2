"""Everything the collectives need from an array, behind one small interface (collectives).

Algorithms never touch numpy directly: they ask an `ArrayBackend` for the bytes of a span
to send, and to reduce or write received bytes into a span. The GPU backend (cupy, in
cuda.py) plugs in here without changing any algorithm; `backend_of` finds it by the array's
type, without importing cupy unless such an array is passed.

Arrays handed to algorithms are flat (1-D) and C-contiguous; spans are element ranges.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import ConfigError
from .devices import is_cupy_array
from .ops import UFUNCS, ReduceOp

__all__ = ["NUMPY", "ArrayBackend", "BufferPool", "backend_of"]

Array = Any  # numpy.ndarray here; cupy.ndarray for the GPU backend


class ArrayBackend:
    """numpy implementation; see the module docstring."""

    name = "numpy"

    def owns(self, x: object) -> bool:
        return isinstance(x, np.ndarray)

    def plain(self, x: Array) -> Array:
        """x as a base-class array sharing its memory (np.matrix and other subclasses
        change what reshape and indexing mean)."""
        return x if type(x) is np.ndarray else x.view(np.ndarray)

    def flat_view(self, x: Array) -> Array | None:
        """A flat view sharing x's memory, or None when x is not C-contiguous."""
        if x.flags.c_contiguous and x.dtype.isnative:
            return x.reshape(-1)
        return None

    def copy_flat(self, x: Array, out: Array) -> None:
        """Copy x (any strides, any byte order) into the flat array out."""
        np.copyto(out.reshape(x.shape), x)

    def copy_out(self, flat: Array, x: Array) -> None:
        """Write a flat result back into x (any strides)."""
        np.copyto(x, flat.reshape(x.shape))

    def empty(self, count: int, dtype: np.dtype[Any]) -> Array:
        return np.empty(count, dtype=dtype)

    def payload(self, a: Array, lo: int, hi: int) -> memoryview:
        """The bytes of a[lo:hi], without copying."""
        return memoryview(a[lo:hi].view(np.uint8))  # a byte view works for every dtype

    def view(self, data: memoryview, dtype: np.dtype[Any]) -> Array:
        """Received bytes as a flat array (no copy; writable when the frame is)."""
        return np.frombuffer(data, dtype=dtype)

    def reduce(
        self,
        op: ReduceOp,
        out: Array,
        lo: int,
        hi: int,
        local: Array,
        data: memoryview,
        *,
        data_first: bool,
    ) -> None:
        """out[lo:hi] = op(data, local[lo:hi]) if data_first else op(local[lo:hi], data)."""
        if hi <= lo:
            return
        received = np.frombuffer(data, dtype=out.dtype)
        mine = local[lo:hi]
        ufunc = UFUNCS[op]
        if data_first:
            ufunc(received, mine, out=out[lo:hi])
        else:
            ufunc(mine, received, out=out[lo:hi])

    def combine(self, op: ReduceOp, local: Array, lo: int, hi: int, data: memoryview) -> Array:
        """op(data, local[lo:hi]) as a flat array, for partial results sent on and dropped.

        The received bytes are consumed: when `data` is writable (a frame ZeroMQ handed
        over, ours alone) the result is written over it, so no buffer is allocated and the
        transport forwards that very frame without a copy and without tracking it.
        """
        received = np.frombuffer(data, dtype=local.dtype)
        if data.readonly:
            return UFUNCS[op](received, local[lo:hi])
        return UFUNCS[op](received, local[lo:hi], out=received)

    def writable(self, data: memoryview, dtype: np.dtype[Any]) -> Array | None:
        """Received bytes as a flat array that a result may be written into, or None
        (read-only bytes; a device backend, whose results live on the device)."""
        return None if data.readonly else np.frombuffer(data, dtype=dtype)

    def write(self, out: Array, lo: int, hi: int, data: memoryview) -> None:
        """out[lo:hi] = the received bytes."""
        if hi > lo:
            out[lo:hi] = np.frombuffer(data, dtype=out.dtype)

    def copy(self, out: Array, lo: int, hi: int, src: Array) -> None:
        """out[lo:hi] = src[lo:hi]."""
        if hi > lo:
            out[lo:hi] = src[lo:hi]

    def scale(self, out: Array, lo: int, hi: int, world_size: int) -> None:
        """out[lo:hi] /= world_size (the last step of op='avg')."""
        if hi > lo:
            np.divide(out[lo:hi], world_size, out=out[lo:hi], casting="unsafe")


NUMPY = ArrayBackend()


def backend_of(x: object, what: str = "x") -> ArrayBackend:
    """The backend for x's array type; ConfigError when x is not an array dsml knows.

    For a cupy array this imports cupy (and dsml's CUDA module) on first use.
    """
    if NUMPY.owns(x):
        return NUMPY
    if is_cupy_array(x):
        from . import cuda  # cupy is imported only when a cupy array is seen

        return cuda.cupy_backend(cuda.device_index(x))
    raise ConfigError(
        f"{what} must be a numpy array (or a cupy array), got {type(x).__name__}; "
        "wrap it with numpy.asarray"
    )


class BufferPool:
    """Reusable flat work buffers, so large collectives do not page-fault fresh memory.

    Writing a freshly allocated 64 MiB buffer costs several times more than reusing one
    (first-touch page faults), so buffers go back to the pool after a successful call,
    with the receipts of sends still reading them: a buffer is handed out again only once
    ZeroMQ is done with it. Buffers of a failed call are not returned.
    """

    def __init__(self, backend: ArrayBackend, *, max_cached_bytes: int = 512 << 20) -> None:
        self._backend = backend
        self._free: list[tuple[Array, list[Any]]] = []
        self._max_cached_bytes = max_cached_bytes

    def acquire(self, count: int, dtype: np.dtype[Any]) -> Array:
        """A flat buffer of count elements (contents undefined)."""
        nbytes = count * dtype.itemsize
        for index, (raw, receipts) in enumerate(self._free):
            if nbytes <= raw.nbytes <= 2 * nbytes + 4096 and all(r.done() for r in receipts):
                del self._free[index]
                return raw[:nbytes].view(dtype)
        return self._backend.empty(max(nbytes, 1), np.dtype(np.uint8))[:nbytes].view(dtype)

    def release(self, buf: Array, receipts: list[Any] | None = None) -> None:
        """Give back a buffer from `acquire`; `receipts` are sends still reading it."""
        raw = buf
        while raw.base is not None:
            raw = raw.base
        if raw.nbytes < 64 * 1024:
            return  # small buffers are cheap to allocate
        self._free.append((raw, [r for r in receipts or () if not r.done()]))
        while sum(b.nbytes for b, _ in self._free) > self._max_cached_bytes:
            self._free.pop(0)

    @property
    def cached_bytes(self) -> int:
        return sum(b.nbytes for b, _ in self._free)

    def __repr__(self) -> str:
        return (
            f"<BufferPool {self._backend.name} buffers={len(self._free)} bytes={self.cached_bytes}>"
        )
