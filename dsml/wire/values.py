"""Plain values with raw array frames, without pickle (wire layer).

A job's result travels from a worker to the client, and the client must not run code a
worker chose: so results are not pickled. `pack_value` writes None, bool, int, float,
complex, str, bytes, lists, tuples, dicts, numpy scalars and numpy arrays (cupy arrays are
copied to the host) as one msgpack header; each array's bytes follow as a raw frame of its
own, so a large array is neither copied into the header nor pickled. `unpack_value`
accepts untrusted bytes and raises nothing but `ProtocolError`.

Arrays are named by dtype name ("float32", "bfloat16"), in native byte order and C order;
unpacked arrays are new, writable arrays.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 and friends with numpy)
import msgpack
import numpy as np

from ..errors import ProtocolError

__all__ = ["MAX_VALUE_HEADER_BYTES", "pack_value", "unpack_value"]

MAX_VALUE_HEADER_BYTES = 16 << 20
_MAX_FRAMES = 4096
_MAX_DIMS = 64
#: Extension types nest by calling msgpack again (a C stack frame of ~32 KB each): deeper
#: values could overflow the C stack of whoever unpacks them.
_MAX_EXT_DEPTH = 32
_ARRAY, _TUPLE, _SCALAR, _COMPLEX = 1, 2, 3, 4
_KINDS = frozenset("biufcV")  # V: ml_dtypes' bfloat16 and float8 types report kind "V"


def _dtype_name(dtype: np.dtype[Any]) -> str:
    if dtype.kind not in _KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise TypeError(f"arrays of dtype {dtype} cannot be sent: use a numeric or bool dtype")
    name = dtype.name
    if dtype.kind == "V":  # ml_dtypes' types have a name numpy knows; plain void has not
        try:
            known = np.dtype(name) == dtype
        except TypeError:
            known = False
        if not known:
            raise TypeError(f"arrays of dtype {dtype} cannot be sent: use a numeric dtype")
    return name


class _Packer:
    def __init__(self) -> None:
        self.frames: list[memoryview] = []
        self._depth = 0

    def pack(self, value: Any) -> bytes:
        if self._depth >= _MAX_EXT_DEPTH:
            raise TypeError(
                f"the value nests tuples, arrays or numpy scalars more than {_MAX_EXT_DEPTH} "
                "deep: flatten it"
            )
        self._depth += 1
        try:
            data: bytes = msgpack.packb(value, default=self._default, strict_types=True)
        finally:
            self._depth -= 1
        return data

    def _default(self, value: Any) -> Any:
        if hasattr(value, "__cuda_array_interface__") and hasattr(value, "get"):
            value = value.get()  # a cupy array comes back as numpy
        if isinstance(value, np.ndarray):
            name = _dtype_name(value.dtype)
            native = value.astype(value.dtype.newbyteorder("="), copy=False)
            flat = np.ascontiguousarray(native)
            if len(self.frames) >= _MAX_FRAMES:
                raise TypeError(f"a value may hold at most {_MAX_FRAMES} arrays")
            self.frames.append(memoryview(flat.reshape(-1).view(np.uint8)))  # type: ignore[arg-type]
            return msgpack.ExtType(
                _ARRAY, self.pack([len(self.frames) - 1, name, list(value.shape)])
            )
        if isinstance(value, np.generic):
            name = _dtype_name(value.dtype)
            return msgpack.ExtType(_SCALAR, self.pack([name, value.tobytes()]))
        if isinstance(value, tuple):
            return msgpack.ExtType(_TUPLE, self.pack(list(value)))
        if isinstance(value, complex):
            return msgpack.ExtType(_COMPLEX, self.pack([value.real, value.imag]))
        if isinstance(value, bool | int | float | str | bytes):  # subclasses (IntEnum, ...)
            for base in (bool, int, float, str, bytes):
                if isinstance(value, base):
                    return base(value)  # type: ignore[arg-type]
        if isinstance(value, Mapping):
            return dict(value)
        if isinstance(value, list | range):
            return list(value)
        raise TypeError(
            f"a {type(value).__module__}.{type(value).__qualname__} cannot be sent back: "
            "return plain data (None, bool, int, float, complex, str, bytes, list, tuple, "
            "dict, numpy arrays and scalars)"
        )


def pack_value(value: Any) -> tuple[bytes, list[memoryview]]:
    """Encode value as (header, array frames). Raises TypeError for unsupported types."""
    packer = _Packer()
    try:
        header = packer.pack(value)
    except ValueError as exc:  # msgpack: too deep, int too large
        raise TypeError(f"the value cannot be sent back: {exc}") from None
    return header, packer.frames


class _Unpacker:
    def __init__(self, frames: Sequence[memoryview]) -> None:
        self.frames = frames
        self.used: set[int] = set()
        self._depth = 0

    def unpack(self, data: bytes | memoryview) -> Any:
        if self._depth >= _MAX_EXT_DEPTH:
            raise ProtocolError(f"a value nested more than {_MAX_EXT_DEPTH} deep")
        self._depth += 1
        try:
            return msgpack.unpackb(data, ext_hook=self._ext, strict_map_key=False, use_list=True)
        finally:
            self._depth -= 1

    def _ext(self, code: int, data: bytes) -> Any:
        if code == _ARRAY:
            return self._array(self.unpack(data))
        if code == _SCALAR:
            item = self.unpack(data)
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], bytes)):
                raise ProtocolError("malformed numpy scalar")
            dtype = _parse_dtype(item[0])
            if len(item[1]) != dtype.itemsize:
                raise ProtocolError("numpy scalar of the wrong size")
            return np.frombuffer(item[1], dtype=dtype)[0]
        if code == _TUPLE:
            items = self.unpack(data)
            if not isinstance(items, list):
                raise ProtocolError("malformed tuple")
            return tuple(items)
        if code == _COMPLEX:
            parts = self.unpack(data)
            if not (isinstance(parts, list) and len(parts) == 2):
                raise ProtocolError("malformed complex number")
            if not all(type(p) is float for p in parts):
                raise ProtocolError("malformed complex number")
            return complex(parts[0], parts[1])
        raise ProtocolError(f"unknown value extension {code}")

    def _array(self, spec: Any) -> np.ndarray[Any, Any]:
        if not (isinstance(spec, list) and len(spec) == 3 and type(spec[0]) is int):
            raise ProtocolError("malformed array header")
        index, name, shape = spec
        if not 0 <= index < len(self.frames) or index in self.used:
            raise ProtocolError(f"array frame {index} is missing or used twice")
        self.used.add(index)
        dtype = _parse_dtype(name)
        if not (isinstance(shape, list) and len(shape) <= _MAX_DIMS):
            raise ProtocolError("malformed array shape")
        if not all(type(d) is int and d >= 0 for d in shape):
            raise ProtocolError("malformed array shape")
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        frame = self.frames[index]
        if frame.nbytes != count * dtype.itemsize:
            raise ProtocolError(
                f"array frame of {frame.nbytes} bytes does not hold {shape} of {name}"
            )
        return np.frombuffer(frame, dtype=dtype, count=count).reshape(shape).copy()


def _parse_dtype(name: Any) -> np.dtype[Any]:
    if type(name) is not str or len(name) > 32:
        raise ProtocolError("malformed dtype name")
    try:
        dtype = np.dtype(name)
    except TypeError:
        raise ProtocolError(f"unknown dtype {name!r}") from None
    try:
        _dtype_name(dtype)
    except TypeError as exc:
        raise ProtocolError(str(exc)) from None
    return dtype


def unpack_value(header: bytes | memoryview, frames: Sequence[memoryview]) -> Any:
    """Decode what `pack_value` wrote; untrusted input raises only `ProtocolError`."""
    if len(frames) > _MAX_FRAMES or memoryview(header).nbytes > MAX_VALUE_HEADER_BYTES:
        raise ProtocolError(f"a value of {len(frames)} frames")
    unpacker = _Unpacker(frames)
    try:
        value = unpacker.unpack(header)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack's many exception types on garbage
        raise ProtocolError(f"malformed value: {type(exc).__name__}: {exc}") from None
    if len(unpacker.used) != len(frames):
        raise ProtocolError("a value carried array frames it did not use")
    return value
