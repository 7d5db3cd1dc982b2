"""CUDA specifics behind dsml's small interfaces (collectives layer; imports cupy).

Imported only when a cupy array is seen or a CUDA device is asked for (see devices.py), so
`import dsml` never imports cupy. cupy has no type stubs: its objects are typed `Any`.

* `CudaCopies` implements `staging.StagedCopies`: copies between a cupy array and a pinned
  numpy twin with `cudaMemcpyAsync` on a stream of dsml's own per device (blocking with
  respect to the legacy default stream), ordered after the caller's current stream through
  an event. Host-staged collectives (the default, `CommConfig.gpu_reduce="host"`) run the
  numpy algorithms on the twin.
* `CupyBackend` is the `ArrayBackend` for `gpu_reduce="device"`: algorithms see cupy arrays
  and reductions run as cupy kernels; each payload crosses to pinned memory on its own.

Run on an H100 (CUDA 13, cupy 14) by tests/gpu and benchmarks/gpu_allreduce.py; the figures
are in docs/operations.md.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np

from .arrays import Array, ArrayBackend
from .devices import is_cupy_array, load_cupy
from .ops import ReduceOp

__all__ = [
    "CudaCopies",
    "CupyBackend",
    "caller_stream",
    "cupy_backend",
    "device_index",
    "pinned_empty",
    "to_device",
    "use_device",
]

cp: Any = load_cupy()

_lock = threading.RLock()  # cupy_backend() creates a stream under it
_streams: dict[int, Any] = {}
_backends: dict[int, CupyBackend] = {}
#: (event, buffers) of queued copies: the buffers stay referenced until the event is done,
#: even when the call that queued them failed before waiting (a DMA engine may still write
#: into a pinned buffer that would otherwise go back to cupy's pool and to another call).
_in_flight: list[tuple[Any, object]] = []


def device_index(x: Array) -> int:
    return int(x.device.id)


def dsml_stream(device: int) -> Any:
    """dsml's own stream on a device (one per process and device, created on first use)."""
    with _lock:
        if device not in _streams:
            with cp.cuda.Device(device):
                _streams[device] = cp.cuda.Stream(non_blocking=False)
        return _streams[device]


def caller_stream(x: Array) -> Any:
    """The current stream, in the calling thread, of the device x lives on."""
    return cp.cuda.get_current_stream(device_index(x))


def use_device(index: int) -> None:
    """Make cuda:index the calling thread's current device (like torch.cuda.set_device)."""
    cp.cuda.Device(index).use()


def pinned_empty(count: int, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """A flat numpy array in page-locked memory (from cupy's caching pinned pool)."""
    nbytes = count * dtype.itemsize
    memory = cp.cuda.alloc_pinned_memory(max(nbytes, 1))
    return np.frombuffer(memory, dtype=np.uint8, count=nbytes).view(dtype)


def _keep_until(event: Any, buffers: object) -> None:
    with _lock:
        _in_flight[:] = [(e, b) for e, b in _in_flight if not e.done]
        _in_flight.append((event, buffers))


def _event(stream: Any) -> Any:
    event = cp.cuda.Event(block=True, disable_timing=True)  # block: sleep, do not spin
    event.record(stream)
    return event


async def _wait_event(event: Any) -> None:
    if not event.done:
        await asyncio.to_thread(event.synchronize)  # the loop keeps running meanwhile


def _memcpy(dst: int, src: int, nbytes: int, kind: int, stream: Any) -> None:
    if nbytes:
        cp.cuda.runtime.memcpyAsync(dst, src, nbytes, kind, stream.ptr)


class CudaCopies:
    """Copies between one cupy array and its pinned host twin (see staging.StagedCopies)."""

    def __init__(self, x: Array, host: np.ndarray[Any, Any], caller: Any | None = None) -> None:
        self.host = host
        self._x = x
        self._device = device_index(x)
        self._stream = dsml_stream(self._device)
        self._caller = caller if caller is not None else caller_stream(x)
        self._contiguous = bool(x.flags.c_contiguous)
        self._src: Any = None  # flat contiguous device source of downloads
        self._dst: Any = None  # flat contiguous device target of uploads
        self._itemsize = x.dtype.itemsize

    def after_caller(self) -> None:
        with cp.cuda.Device(self._device):
            self._stream.wait_event(_event(self._caller))

    def _flat(self, for_upload: bool) -> Any:
        with cp.cuda.Device(self._device), self._stream:
            if self._contiguous:
                return self._x.reshape(-1)
            if for_upload:
                return cp.empty(self._x.size, self._x.dtype)
            return cp.ascontiguousarray(self._x).reshape(-1)  # queued on our stream

    def _copy(self, lo: int, hi: int, *, upload: bool) -> Any:
        flat = self._dst if upload else self._src
        if flat is None:
            flat = self._flat(upload)
            if upload:
                self._dst = flat
            else:
                self._src = flat
        offset, nbytes = lo * self._itemsize, (hi - lo) * self._itemsize
        device_ptr = int(flat.data.ptr) + offset
        host_ptr = int(self.host.ctypes.data) + offset
        runtime = cp.cuda.runtime
        with cp.cuda.Device(self._device):
            if upload:
                _memcpy(device_ptr, host_ptr, nbytes, runtime.memcpyHostToDevice, self._stream)
            else:
                _memcpy(host_ptr, device_ptr, nbytes, runtime.memcpyDeviceToHost, self._stream)
            event = _event(self._stream)
        _keep_until(event, (self.host, flat))
        return event

    def to_host(self, lo: int, hi: int) -> Any:
        return self._copy(lo, hi, upload=False)

    def to_device(self, lo: int, hi: int) -> Any:
        return self._copy(lo, hi, upload=True)

    def commit(self) -> Any:
        with cp.cuda.Device(self._device), self._stream:
            if not self._contiguous and self._dst is not None:
                self._x[...] = self._dst.reshape(self._x.shape)
            return _event(self._stream)

    async def wait(self, token: object) -> None:
        await _wait_event(token)

    def drain(self) -> None:
        self._stream.synchronize()

    def __repr__(self) -> str:
        return f"<CudaCopies cuda:{self._device} {self._x.dtype} shape={self._x.shape}>"


async def to_device(result: np.ndarray[Any, Any], device: int) -> Any:
    """A new cupy array on cuda:device holding result; returns once it is there."""
    stream = dsml_stream(device)
    with cp.cuda.Device(device):
        out = cp.empty(result.shape, result.dtype)
        if result.size:
            out.set(np.ascontiguousarray(result), stream=stream)
        event = _event(stream)
    await _wait_event(event)
    return out


async def finish(device: int) -> None:
    """Wait until everything dsml queued on its stream of `device` is done."""
    with cp.cuda.Device(device):
        event = _event(dsml_stream(device))
    await _wait_event(event)


def after_caller(x: Array, caller: Any | None) -> None:
    """Make dsml's stream of x's device wait for the work queued on the caller's stream."""
    device = device_index(x)
    with cp.cuda.Device(device):
        stream = caller if caller is not None else caller_stream(x)
        dsml_stream(device).wait_event(_event(stream))


_UFUNCS = {
    ReduceOp.SUM: "add",
    ReduceOp.AVG: "add",
    ReduceOp.PROD: "multiply",
    ReduceOp.MIN: "minimum",
    ReduceOp.MAX: "maximum",
    ReduceOp.BAND: "bitwise_and",
    ReduceOp.BOR: "bitwise_or",
    ReduceOp.BXOR: "bitwise_xor",
}


class CupyBackend(ArrayBackend):
    """cupy arrays on one device; every operation is queued on dsml's stream there.

    Payloads are copied into fresh pinned buffers and the stream is synchronised before the
    bytes are handed to ZeroMQ; received bytes are copied onto the device before reducing.
    """

    def __init__(self, device: int) -> None:
        self.name = f"cupy:{device}"
        self._device = device
        self._stream = dsml_stream(device)

    def _on_device(self) -> Any:
        return _Context(cp.cuda.Device(self._device), self._stream)

    def owns(self, x: object) -> bool:
        return is_cupy_array(x) and device_index(x) == self._device

    def plain(self, x: Array) -> Array:
        return x

    def flat_view(self, x: Array) -> Array | None:
        return x.reshape(-1) if x.flags.c_contiguous else None

    def copy_flat(self, x: Array, out: Array) -> None:
        with self._on_device():
            out.reshape(x.shape)[...] = x

    def copy_out(self, flat: Array, x: Array) -> None:
        with self._on_device():
            x[...] = flat.reshape(x.shape)

    def empty(self, count: int, dtype: np.dtype[Any]) -> Array:
        with self._on_device():
            return cp.empty(count, dtype=dtype)

    def payload(self, a: Array, lo: int, hi: int) -> memoryview:
        host: Any = pinned_empty(hi - lo, a.dtype)
        if hi > lo:
            itemsize = a.dtype.itemsize
            src = int(a.data.ptr) + lo * itemsize
            with cp.cuda.Device(self._device):
                kind = cp.cuda.runtime.memcpyDeviceToHost
                _memcpy(int(host.ctypes.data), src, (hi - lo) * itemsize, kind, self._stream)
                self._stream.synchronize()  # ZeroMQ may read the bytes as soon as we return
        return memoryview(host.view(np.uint8))

    def _received(self, data: memoryview, dtype: np.dtype[Any]) -> Array:
        with self._on_device():
            out = cp.empty(data.nbytes // dtype.itemsize, dtype=dtype)
            if data.nbytes:
                out.set(np.frombuffer(data, dtype=dtype), stream=self._stream)
            return out

    def view(self, data: memoryview, dtype: np.dtype[Any]) -> Array:
        return self._received(data, dtype)

    def writable(self, data: memoryview, dtype: np.dtype[Any]) -> Array | None:
        return None  # results live on the device, never in a received host frame

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
        if hi <= lo:
            return
        received = self._received(data, out.dtype)
        ufunc = getattr(cp, _UFUNCS[op])
        with self._on_device():
            if data_first:
                ufunc(received, local[lo:hi], out=out[lo:hi])
            else:
                ufunc(local[lo:hi], received, out=out[lo:hi])

    def combine(self, op: ReduceOp, local: Array, lo: int, hi: int, data: memoryview) -> Array:
        received = self._received(data, local.dtype)
        with self._on_device():
            return getattr(cp, _UFUNCS[op])(received, local[lo:hi])

    def write(self, out: Array, lo: int, hi: int, data: memoryview) -> None:
        if hi > lo:
            with self._on_device():
                out[lo:hi].set(np.frombuffer(data, dtype=out.dtype), stream=self._stream)

    def copy(self, out: Array, lo: int, hi: int, src: Array) -> None:
        if hi > lo:
            with self._on_device():
                out[lo:hi] = src[lo:hi]

    def scale(self, out: Array, lo: int, hi: int, world_size: int) -> None:
        if hi > lo:
            with self._on_device():
                out[lo:hi] /= world_size


class _Context:
    """`with device, stream:` as one object (cupy's contexts nest in this order)."""

    def __init__(self, device: Any, stream: Any) -> None:
        self._device, self._stream = device, stream

    def __enter__(self) -> None:
        self._device.__enter__()
        self._stream.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._stream.__exit__(*exc)
        self._device.__exit__(*exc)


def cupy_backend(device: int) -> CupyBackend:
    """The backend for cupy arrays on cuda:device (one per device)."""
    with _lock:
        if device not in _backends:
            _backends[device] = CupyBackend(device)
        return _backends[device]
