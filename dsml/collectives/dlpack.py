"""Read a DLPack capsule as a numpy array sharing its memory (collectives layer).

numpy's own `from_dlpack` refuses bfloat16 (DLPack type code 4), which torch and JAX use
for training, so dsml reads host-memory capsules itself: the structs below follow the
DLPack headers (v0.8 `DLManagedTensor`, capsule "dltensor"; v1.x
`DLManagedTensorVersioned`, capsule "dltensor_versioned"). No third-party module is
imported; the producer is asked through its `__dlpack__` method only.

Ownership: the capsule is not renamed "used_..." so the producer's capsule destructor
still runs the tensor's deleter; the returned array keeps the capsule alive through its
base (a ctypes buffer holding a reference to it), and the producer's memory lives as long
as the array or any view of it does.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from ..errors import ConfigError

__all__ = ["CPU_DEVICES", "CUDA_DEVICES", "Exported", "dlpack_device", "export_host"]

#: DLPack device types whose memory the CPU can read and write: CPU, CUDA pinned host.
CPU_DEVICES = frozenset({1, 3})
#: Device types cupy can take: CUDA, CUDA managed, ROCm.
CUDA_DEVICES = frozenset({2, 10, 13})

_READ_ONLY = 1 << 0  # DLPACK_FLAG_BITMASK_READ_ONLY
_IS_COPIED = 1 << 1  # DLPACK_FLAG_BITMASK_IS_COPIED


class _Device(ctypes.Structure):
    _fields_ = (("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32))


class _DataType(ctypes.Structure):
    _fields_ = (("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16))


class _Tensor(ctypes.Structure):
    _fields_ = (
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int32),
        ("dtype", _DataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    )


class _Managed(ctypes.Structure):  # DLManagedTensor (unversioned)
    _fields_ = (
        ("dl_tensor", _Tensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    )


class _Version(ctypes.Structure):
    _fields_ = (("major", ctypes.c_uint32), ("minor", ctypes.c_uint32))


class _ManagedVersioned(ctypes.Structure):  # DLManagedTensorVersioned (DLPack >= 1.0)
    _fields_ = (
        ("version", _Version),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _Tensor),
    )


_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = (ctypes.py_object,)
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = (ctypes.py_object, ctypes.c_char_p)

# (type code, bits) -> numpy dtype; DLPack codes: 0 int, 1 uint, 2 float, 4 bfloat,
# 5 complex, 6 bool.
_DTYPES: dict[tuple[int, int], np.dtype[Any]] = {
    (6, 8): np.dtype(np.bool_),
    (0, 8): np.dtype(np.int8),
    (0, 16): np.dtype(np.int16),
    (0, 32): np.dtype(np.int32),
    (0, 64): np.dtype(np.int64),
    (1, 8): np.dtype(np.uint8),
    (1, 16): np.dtype(np.uint16),
    (1, 32): np.dtype(np.uint32),
    (1, 64): np.dtype(np.uint64),
    (2, 16): np.dtype(np.float16),
    (2, 32): np.dtype(np.float32),
    (2, 64): np.dtype(np.float64),
    (4, 16): np.dtype(ml_dtypes.bfloat16),
    (5, 64): np.dtype(np.complex64),
    (5, 128): np.dtype(np.complex128),
}


@dataclass(frozen=True, slots=True)
class Exported:
    """A producer's host memory as a numpy array, and whether dsml may write into it."""

    array: np.ndarray[Any, Any]
    writable: bool  # False: read-only, or the producer handed out a copy


def dlpack_device(x: Any, what: str) -> tuple[int, int]:
    """x's `__dlpack_device__()` (device type, index); ConfigError when it fails."""
    try:
        kind, index = x.__dlpack_device__()
        return int(kind), int(index)
    except Exception as exc:
        raise ConfigError(
            f"{what} ({type(x).__name__}) has __dlpack__ but no usable __dlpack_device__: {exc}"
        ) from exc


def export_host(x: Any, what: str) -> Exported:
    """x's memory (x has `__dlpack__`, on a CPU-readable device) as a numpy array.

    Raises:
        ConfigError: the producer refused to export, or its dtype is not one dsml knows.
    """
    capsule = _capsule(x, what)
    name = _capsule_name(capsule)
    if name == b"dltensor_versioned":
        managed: Any = _ManagedVersioned.from_address(_capsule_pointer(capsule, name))
        flags = int(managed.flags)
    elif name == b"dltensor":
        managed = _Managed.from_address(_capsule_pointer(capsule, name))
        flags = 0
    else:
        raise ConfigError(f"{what}.__dlpack__() returned a capsule named {name!r}, not a tensor")
    array = _as_numpy(managed.dl_tensor, capsule, what)
    writable = not flags & (_READ_ONLY | _IS_COPIED)
    if not flags & _READ_ONLY:
        return Exported(array, writable)
    array.flags.writeable = False
    return Exported(array, False)


def _capsule(x: Any, what: str) -> Any:
    try:
        try:
            return x.__dlpack__(max_version=(1, 1))
        except TypeError:  # a producer from before DLPack 1.0 takes no max_version
            return x.__dlpack__()
    except ConfigError:
        raise
    except Exception as exc:  # the producer's own refusal (e.g. requires_grad, conj bit)
        raise ConfigError(
            f"{what} ({type(x).__name__}) could not be exported through DLPack: {exc}"
        ) from exc


def _as_numpy(tensor: _Tensor, capsule: Any, what: str) -> np.ndarray[Any, Any]:
    """A numpy view of a DLTensor in host memory, keeping `capsule` alive."""
    code, bits, lanes = tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes
    dtype = _DTYPES.get((code, bits))
    if dtype is None or lanes != 1:
        raise ConfigError(
            f"{what} has a DLPack dtype dsml does not support (code {code}, {bits} bits, "
            f"{lanes} lanes); use bool, int8..int64, uint8..uint64, float16/32/64, bfloat16 "
            "or complex64/128"
        )
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    itemsize = dtype.itemsize
    if tensor.strides:
        strides = tuple(tensor.strides[i] * itemsize for i in range(tensor.ndim))
    else:  # NULL strides mean C order
        strides = tuple(int(s) * itemsize for s in _c_strides(shape))
    if 0 in shape:
        return np.empty(shape, dtype)  # no memory to share; nothing will be written
    low = sum((n - 1) * s for n, s in zip(shape, strides, strict=True) if s < 0)
    high = sum((n - 1) * s for n, s in zip(shape, strides, strict=True) if s > 0) + itemsize
    start = (tensor.data or 0) + tensor.byte_offset + low
    buffer: Any = (ctypes.c_char * (high - low)).from_address(start)
    buffer.capsule = capsule  # the producer's memory lives as long as this buffer
    return np.ndarray(shape, dtype, buffer=buffer, offset=-low, strides=strides)


def _c_strides(shape: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return strides[::-1]
