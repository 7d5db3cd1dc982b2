"""Where a call's data lives: cupy inputs, CUDA results, comm.device (communicator layer).

The planner plans every call as if for a numpy array. For a cupy input, `Placement.place`
gives the array to plan for and an `OnDevice` that adapts the plan to the device array, in
one of two ways (`CommConfig.gpu_reduce`):

* "host" (default): the array is staged to a pinned numpy twin chunk by chunk (copies
  queued at call time, after the caller's stream), the numpy algorithm runs on the twin,
  and the result is copied back chunk by chunk only after the call succeeded. Every
  reduction is numpy's, so numpy and cupy ranks produce the same bits.
* "device": the algorithm runs on the cupy array through `CupyBackend`; reductions are cupy
  kernels on dsml's stream.

Either way the fingerprint is the numpy plan's: it does not name the device, so a rank
holding a numpy array and one holding a cupy array of the same dtype and shape match.
New arrays (all_gather, gather, scatter, reduce_scatter, all_to_all) land on the input's
device; calls without an input (recv, scatter on a non-root) give arrays on `comm.device`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from ..collectives.devices import is_cupy_array
from ..collectives.ops import dtype_name
from ..collectives.staging import Download, StagedCopies, upload
from .call import Call
from .plan_base import Plan

__all__ = ["OnDevice", "Placement", "staged"]

Array = Any
GPU_REDUCE = ("host", "device")


class Placement:
    """The device rules of one communicator (see the module docstring)."""

    def __init__(self, device: str, gpu_reduce: str, chunk_bytes: int) -> None:
        self.device = device  # "cpu" or "cuda:N"
        self._gpu_reduce = gpu_reduce
        self._chunk_bytes = chunk_bytes

    def caller_stream(self, x: object) -> Any:
        """For a cupy array, the calling thread's current stream on its device; else None.

        Taken in the caller's thread, because collectives are planned on the loop's thread
        and CUDA's current stream is per thread.
        """
        if not is_cupy_array(x):
            return None
        from ..collectives import cuda  # only once a cupy array is seen

        return cuda.caller_stream(x)

    def place(self, x: Array, caller: Any) -> tuple[Array, OnDevice | None]:
        """The array to plan the call for, and how to run that plan for x (None: x is
        a numpy array and the plan runs as it is).

        With gpu_reduce="host" the plan is made for a pinned numpy twin of the cupy array
        x; with "device", for x itself (`CupyBackend`).
        """
        if not is_cupy_array(x):
            return x, None
        from ..collectives import cuda  # only once a cupy array is seen

        dtype_name(x.dtype)  # fail on an unsupported dtype before allocating anything
        if self._gpu_reduce == "device":
            return x, OnDevice(x, caller, None, self._chunk_bytes)
        host = cuda.pinned_empty(x.size, x.dtype).reshape(x.shape)
        return host, OnDevice(x, caller, host, self._chunk_bytes)

    async def on_device(self, result: Array) -> Array:
        """A result of a call without input, moved to comm.device."""
        if self.device == "cpu" or result is None:
            return result
        from ..collectives import cuda

        return await cuda.to_device(result, int(self.device.split(":")[1]))

    def __repr__(self) -> str:
        return f"<Placement device={self.device} gpu_reduce={self._gpu_reduce}>"


class OnDevice:
    """Runs a plan made for a cupy array's stand-in on that array's behalf."""

    def __init__(
        self, x: Array, caller: Any, host: np.ndarray[Any, Any] | None, chunk_bytes: int
    ) -> None:
        self._x = x
        self._caller = caller
        self._host = host  # the pinned twin ("host"), or None: the plan uses x ("device")
        self._chunk_bytes = chunk_bytes

    def adapt(self, plan: Plan, *, needs_input: bool = True, writes_back: bool = True) -> Plan:
        """`plan` (made for `Placement.place`'s array) as a plan for the device array."""
        from ..collectives import cuda

        x, host = self._x, self._host
        device = cuda.device_index(x)
        if host is None:
            cuda.after_caller(x, self._caller)

            async def on_device(call: Call) -> Any:
                result = await plan.body(call)
                await cuda.finish(device)
                return result

            return Plan(plan.fingerprint, on_device)
        copies = cuda.CudaCopies(x, host.reshape(-1), self._caller)

        async def new_array(result: np.ndarray[Any, Any]) -> Any:
            return await cuda.to_device(result, device)

        return staged(
            plan,
            x,
            host,
            copies,
            chunk=max(1, self._chunk_bytes // x.dtype.itemsize),  # elements per staged chunk
            needs_input=needs_input,
            writes_back=writes_back,
            new_array=new_array,
        )


def staged(
    plan: Plan,
    x: Array,
    host: np.ndarray[Any, Any],
    copies: StagedCopies,
    *,
    chunk: int,
    needs_input: bool,
    writes_back: bool,
    new_array: Callable[[np.ndarray[Any, Any]], Awaitable[Array]],
) -> Plan:
    """Run `plan` (made for `host`, the pinned twin of device array `x`) on x's behalf.

    The download is queued now, at call time, so it is ordered after the work the caller
    queued before calling; x is written only after the plan succeeded.
    """
    download = Download(copies, host.size, chunk) if needs_input else None

    async def body(call: Call) -> Any:
        try:
            if download is not None:
                await download.wait()
            result = await plan.body(call)
        except BaseException:
            if download is not None:
                download.abandon()  # no copy may still write into host once it is freed
            raise
        if result is host:  # an in-place result
            if writes_back:
                await upload(copies, host.size, chunk)
            return x
        if result is None:
            return None
        return await new_array(result)

    return Plan(plan.fingerprint, body)
