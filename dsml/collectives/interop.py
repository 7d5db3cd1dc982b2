"""Arrays from other libraries: torch, JAX, DLPack and buffer objects (collectives layer).

The collectives work on numpy and cupy arrays. Everything else that has `__dlpack__` or
the buffer protocol is converted here, once, at the communicator's edge (`native_arrays`
decorates its public methods), and results are converted back to the caller's type:

* torch CPU tensors (every dtype, strided too): dsml works on a numpy view of the
  tensor's memory. In-place calls (all_reduce, broadcast, reduce at the root) write into
  the tensor and return it, without a copy; new results are torch tensors.
* torch CUDA tensors: a cupy view (cupy must be installed); results as torch tensors on
  the input's device.
* JAX arrays are read-only: in-place calls write into a copy and return a new JAX array,
  leaving the input untouched; new results are JAX arrays. (A pushed collective sets the
  new array as its var's data: `writes_in_place`.)
* Any other `__dlpack__` object: written in place (and returned) when writable; new
  results are numpy (or cupy) arrays.
* memoryview and bytearray are written in place; new results have the input's type
  (bytes-likes are uint8). `bytes` is read-only: results are new `bytes`.
* Other buffer objects (array.array, mmap): written in place, with the buffer's own
  format ('b' is int8); new results are numpy.
* A buffer numpy cannot read (a released memoryview, a closed mmap) and a torch negative
  view (exported without its sign) are `ConfigError`s, so the call still takes its turn.
* Calls without an input array (recv; scatter on a non-root) give numpy (or cupy) arrays.

No library is imported here: objects are told apart by their type's module name, and
converting back uses the library the caller already imported (`sys.modules`).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import ml_dtypes
import numpy as np

from ..errors import ConfigError
from .devices import CUPY_HINT, is_cupy_array, load_cupy
from .dlpack import CPU_DEVICES, CUDA_DEVICES, dlpack_device, export_host

__all__ = [
    "ConvertingHandle",
    "Native",
    "like",
    "native_arrays",
    "to_native",
    "with_native",
    "writes_in_place",
]

P = ParamSpec("P")
S = TypeVar("S")
H = TypeVar("H")
T = TypeVar("T")

#: Libraries whose arrays are immutable: written results come back as new arrays.
_IMMUTABLE = frozenset({"jax", "jaxlib", "tensorflow"})
_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True, slots=True)
class Native:
    """An input as dsml sees it (`array`), and how to give results back (`result`)."""

    array: Any  # numpy.ndarray or cupy.ndarray
    original: Any
    library: str  # "torch", "jax", "memoryview", ... (the input's kind)
    shares_memory: bool  # array is a view of original's memory, which dsml may write

    def result(self, value: Any) -> Any:
        """A collective's result in the caller's type (the caller's object when in place)."""
        if value is None:
            return None
        if value is self.array and self.shares_memory:
            return self.original  # written in place into the caller's memory
        return _convert(value, self.library, self.original)


def is_native(x: object) -> bool:
    """True for what the collectives take as they are (numpy, cupy, None)."""
    return x is None or isinstance(x, np.ndarray) or is_cupy_array(x)


def to_native(x: Any, what: str = "x", *, writes: bool = False) -> Native:
    """x as a numpy or cupy array sharing its memory (a writable copy when `writes` and x
    is read-only).

    Raises:
        ConfigError: x is not an array dsml can take.
    """
    library = _library(x)
    try:
        if hasattr(x, "__dlpack__") and not isinstance(x, memoryview):
            array, writable = _from_dlpack(_detached(x, library, what), what)
            writable = writable and library not in _IMMUTABLE
        elif _has_buffer(x):
            array, writable = _from_buffer(x)
        else:
            raise ConfigError(
                f"{what} must be a numpy array, a cupy array, or any object with __dlpack__ or "
                f"the buffer protocol (torch and JAX arrays, memoryview, bytearray); got "
                f"{type(x).__name__}. Wrap it with numpy.asarray"
            )
    except ConfigError:
        raise
    except (ValueError, TypeError, BufferError) as exc:  # a released memoryview, a closed
        # mmap, a format numpy lacks:
        # a ConfigError, so that the call still takes its turn (see with_native)
        raise ConfigError(f"{what} ({type(x).__name__}) cannot be read as an array: {exc}") from exc
    if writes and not writable:
        array = array.copy()  # read-only input: the result is written into a new array
    return Native(array, x, library, shares_memory=writable)


def native_arrays(
    writes: bool,
) -> Callable[[Callable[Concatenate[S, Any, P], H]], Callable[Concatenate[S, Any, P], H]]:
    """Decorate a communicator method whose first argument is the array: convert a foreign
    array on the way in, and the handle's result on the way out. `writes`: the method
    writes its result into the array (then a read-only input is copied first)."""

    def decorate(
        method: Callable[Concatenate[S, Any, P], H],
    ) -> Callable[Concatenate[S, Any, P], H]:
        @functools.wraps(method)
        def call(self: S, x: Any = None, /, *args: P.args, **kwargs: P.kwargs) -> H:
            if type(x) is np.ndarray:  # the common case, on every call: nothing to convert
                return method(self, x, *args, **kwargs)
            if x is None and "x" in kwargs:  # all_reduce(x=...)
                x = kwargs.pop("x")
            return with_native(x, writes, lambda array: method(self, array, *args, **kwargs))

        return call

    return decorate


def with_native(x: Any, writes: bool, start: Callable[[Any], H]) -> H:
    """`start(x)` with x as dsml's array, its handle's result converted back to x's type.

    For numpy, cupy or None this is just `start(x)`. An object that is refused is passed
    to `start` as it is, so that the call still takes its turn and its peers fail at once
    (it refuses it too); the conversion's own error is raised then.
    """
    if is_native(x):
        return start(x)
    try:
        native = to_native(x, writes=writes)
    except ConfigError as refused:
        try:
            return start(x)  # a call that ignores x here (scatter on a non-root) just runs
        except ConfigError:
            raise refused from refused.__cause__
    return ConvertingHandle(start(native.array), native.result)  # type: ignore[return-value]


class ConvertingHandle(Generic[T]):
    """A collective's handle whose result is converted to the caller's array type.

    It has the handle's interface (await, `done`, `result`, `cancel`, ...); everything but
    the result is the wrapped handle's.
    """

    __slots__ = ("_convert", "_handle")

    def __init__(self, handle: Any, convert: Callable[[Any], T]) -> None:
        self._handle = handle
        self._convert = convert

    def __await__(self) -> Generator[Any, None, T]:
        value = yield from self._handle.__await__()
        return self._convert(value)

    def result(self) -> T:
        return self._convert(self._handle.result())

    def add_done_callback(self, fn: Callable[[ConvertingHandle[T]], object]) -> None:
        self._handle.add_done_callback(lambda _inner: fn(self))

    def __getattr__(self, name: str) -> Any:  # done, cancelled, exception, cancel, cid, ...
        return getattr(self._handle, name)

    def __repr__(self) -> str:
        return repr(self._handle)


# -- into numpy / cupy ----------------------------------------------------------------------


def _library(x: object) -> str:
    kind = type(x)
    if kind in (memoryview, bytearray, bytes):
        return kind.__name__
    return kind.__module__.split(".")[0]


def _detached(x: Any, library: str, what: str) -> Any:
    """A torch tensor that requires grad, detached (same memory): DLPack refuses it. A
    negative view (torch's lazy negation, as in `z.conj().imag`) is refused: DLPack
    exports its memory without the sign."""
    if library != "torch":
        return x
    if getattr(x, "is_neg", None) is not None and x.is_neg():
        raise ConfigError(
            f"{what} is a torch negative view (lazy negation, as in z.conj().imag), which "
            "DLPack would export without its sign; pass x.resolve_neg()"
        )
    if getattr(x, "requires_grad", False):
        return x.detach()
    return x


def _from_dlpack(x: Any, what: str) -> tuple[Any, bool]:
    kind, _index = dlpack_device(x, what)
    if kind in CPU_DEVICES:
        exported = export_host(x, what)
        return exported.array, exported.writable
    if kind in CUDA_DEVICES:
        try:
            cupy = load_cupy()
        except ConfigError as exc:
            raise ConfigError(
                f"{what} is a GPU array ({type(x).__name__}); dsml reads GPU memory through "
                f"cupy, which is not installed: {CUPY_HINT}"
            ) from exc
        try:
            return cupy.from_dlpack(x), True
        except Exception as exc:  # e.g. a dtype cupy lacks (bfloat16)
            raise ConfigError(
                f"{what} ({type(x).__name__}) could not be read by cupy through DLPack: {exc}"
            ) from exc
    raise ConfigError(
        f"{what} lives on DLPack device type {kind}; dsml takes CPU memory and CUDA (cupy)"
    )


def _has_buffer(x: object) -> bool:
    try:
        memoryview(x)  # type: ignore[arg-type]
    except TypeError:
        return False
    except (ValueError, BufferError):  # it has the protocol, but failed (a released view)
        return True
    return True


def _from_buffer(x: Any) -> tuple[np.ndarray[Any, Any], bool]:
    view = memoryview(x)
    array = np.asarray(view)  # keeps the format's dtype ('b': int8), shape and strides
    if array.dtype.kind == "S":  # 'c' (char): bytes, as uint8
        array = array.view(np.uint8)
    return array, not view.readonly


def writes_in_place(x: Any) -> bool:
    """Does an in-place call on x write into x's own memory (rather than a copy, whose
    result comes back as a new object: JAX arrays, bytes)? True for what is refused."""
    if is_native(x):
        return True
    try:
        return to_native(x).shares_memory
    except ConfigError:
        return True


# -- back to the caller's type --------------------------------------------------------------


def like(value: Any, original: Any) -> Any:
    """A numpy or cupy array as an array of `original`'s type (and device), where known."""
    return value if is_native(original) else _convert(value, _library(original), original)


def _convert(value: Any, library: str, original: Any) -> Any:
    """A result array (numpy or cupy, new memory) as the caller's library's array."""
    if not is_native(value):  # converted already (a pushed collective whose data was
        return value  # replaced by an earlier op: converted back for the new data)
    if library == "torch":
        return _to_torch(value, original)
    if library in ("jax", "jaxlib"):
        jnp = sys.modules["jax"].numpy
        return jnp.from_dlpack(value) if is_cupy_array(value) else jnp.asarray(value)
    if library == "memoryview":
        return memoryview(np.ascontiguousarray(value))  # type: ignore[arg-type]
    if library == "bytearray":
        return bytearray(np.ascontiguousarray(value).view(np.uint8))
    if library == "bytes":
        return np.ascontiguousarray(value).tobytes()
    return value


def _to_torch(value: Any, original: Any) -> Any:
    torch = sys.modules["torch"]
    value = value if value.flags.c_contiguous else value.copy()
    if value.dtype == _BFLOAT16:  # numpy cannot export bfloat16 through DLPack
        tensor = torch.from_dlpack(value.view(np.int16)).view(torch.bfloat16)
    else:
        tensor = torch.from_dlpack(value)
    device = getattr(original, "device", None)
    return tensor if device is None or tensor.device == device else tensor.to(device)
