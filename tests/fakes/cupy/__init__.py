"""A stand-in for cupy built on numpy, so dsml's CUDA code paths run without a GPU.

Only on sys.path when a test puts `tests/fakes` there (see tests/gpu_fakes.py). It has just
the parts of cupy that dsml uses. Copies happen at once (memmove), so events are always
done; every stream operation is appended to `LOG`, which lets tests check their order.
`FAKE_CUPY_DEVICES` sets how many GPUs it pretends to have (default 1; 0 means none).
"""

from __future__ import annotations

import ctypes
import os
import types
from typing import Any

import numpy as np

__version__ = "0.0-fake"

LOG: list[tuple[Any, ...]] = []
_current_device = [0]


class _Flags:
    def __init__(self, a: np.ndarray) -> None:
        self.c_contiguous = bool(a.flags.c_contiguous)


class _Pointer:
    def __init__(self, a: np.ndarray) -> None:
        self.ptr = a.ctypes.data


class ndarray:  # cupy's name
    """A numpy array that says it lives on a GPU."""

    def __init__(self, a: np.ndarray, device: int | None = None) -> None:
        self._a = a
        self.device = cuda.Device(_current_device[0] if device is None else device)

    dtype = property(lambda self: self._a.dtype)
    shape = property(lambda self: self._a.shape)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    flags = property(lambda self: _Flags(self._a))
    data = property(lambda self: _Pointer(self._a))
    base = None

    def reshape(self, *shape: Any) -> ndarray:
        return ndarray(self._a.reshape(*shape), self.device.id)

    def __itruediv__(self, value: Any) -> ndarray:
        self._a /= value
        return self

    def view(self, dtype: Any) -> ndarray:
        return ndarray(self._a.view(dtype), self.device.id)

    def __getitem__(self, key: Any) -> ndarray:
        return ndarray(self._a[key], self.device.id)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._a[key] = value._a if isinstance(value, ndarray) else value

    def __len__(self) -> int:
        return len(self._a)

    def get(self) -> np.ndarray:
        return self._a.copy()

    def set(self, array: np.ndarray, stream: Any = None) -> None:
        LOG.append(("set", array.nbytes))
        self._a[...] = array

    def __repr__(self) -> str:
        return f"fake_cupy.ndarray({self._a!r}, device={self.device.id})"


ndarray.__module__ = "cupy"  # how dsml recognises cupy arrays


def asarray(a: Any, dtype: Any = None) -> ndarray:
    return ndarray(np.array(a, dtype=dtype))


def ascontiguousarray(x: ndarray) -> ndarray:
    LOG.append(("ascontiguousarray", x.shape))
    return ndarray(np.ascontiguousarray(x._a), x.device.id)


def empty(shape: Any, dtype: Any = float) -> ndarray:
    return ndarray(np.empty(shape, dtype=dtype))


def zeros(shape: Any, dtype: Any = float) -> ndarray:
    return ndarray(np.zeros(shape, dtype=dtype))


def _ufunc(name: str) -> Any:
    """cupy's elementwise function `name` (used by gpu_reduce="device"), on the arrays' numpy."""

    def apply(a: ndarray, b: ndarray, out: ndarray | None = None) -> ndarray:
        result = getattr(np, name)(a._a, b._a, out=None if out is None else out._a)
        return out if out is not None else ndarray(result, a.device.id)

    return apply


add, multiply, minimum, maximum = (_ufunc(n) for n in ("add", "multiply", "minimum", "maximum"))


def _device_count() -> int:
    return int(os.environ.get("FAKE_CUPY_DEVICES", "1"))


class _Device:
    def __init__(self, index: int = 0) -> None:
        self.id = index
        self._previous: list[int] = []

    def use(self) -> None:
        LOG.append(("use", self.id))
        _current_device[0] = self.id

    def __enter__(self) -> _Device:
        self._previous.append(_current_device[0])
        _current_device[0] = self.id
        return self

    def __exit__(self, *exc: object) -> None:
        _current_device[0] = self._previous.pop()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Device) and other.id == self.id

    def __hash__(self) -> int:
        return self.id


class _Stream:
    _count = 0

    def __init__(self, null: bool = False, non_blocking: bool = False) -> None:
        _Stream._count += 1
        self.ptr = 0 if null else _Stream._count
        self.name = "null" if null else f"stream{self.ptr}"

    def wait_event(self, event: _Event) -> None:
        LOG.append(("wait_event", self.name, event.recorded_on))

    def synchronize(self) -> None:
        LOG.append(("synchronize", self.name))

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __repr__(self) -> str:
        return f"<fake Stream {self.name}>"


class _Event:
    def __init__(self, block: bool = False, disable_timing: bool = False) -> None:
        self.recorded_on: str | None = None
        self.done = True  # copies are synchronous here

    def record(self, stream: _Stream | None = None) -> None:
        self.recorded_on = stream.name if stream is not None else "null"
        LOG.append(("record", self.recorded_on))

    def synchronize(self) -> None:
        pass


_NULL = _Stream(null=True)


def _get_current_stream(device_id: int = -1) -> _Stream:
    return _NULL


def _memcpy_async(dst: int, src: int, size: int, kind: int, stream: int) -> None:
    LOG.append(("memcpy", {1: "H2D", 2: "D2H"}[kind], size, f"stream{stream}"))
    ctypes.memmove(dst, src, size)


def _get_device_count() -> int:
    count = _device_count()
    if count < 0:
        raise RuntimeError("cudaErrorInsufficientDriver (fake)")
    return count


runtime = types.SimpleNamespace(
    getDeviceCount=_get_device_count,
    memcpyAsync=_memcpy_async,
    memcpyHostToDevice=1,
    memcpyDeviceToHost=2,
)
cuda = types.SimpleNamespace(
    Device=_Device,
    Stream=_Stream,
    Event=_Event,
    get_current_stream=_get_current_stream,
    alloc_pinned_memory=lambda size: bytearray(size),
    runtime=runtime,
)
