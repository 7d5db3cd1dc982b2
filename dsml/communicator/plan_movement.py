"""Plans of the collectives that move data without reducing it (communicator layer).

`MovementPlans` plans broadcast, all_gather, gather, scatter, all_to_all and barrier:
each checks its arguments, builds its fingerprint, and returns the coroutine that runs
it, over the same-host shared-memory plane where it has a path for that collective
(shm_hook.py), else over TCP. Results that land in the caller's array (broadcast) are
written only after the algorithm has succeeded.
"""

from __future__ import annotations

from typing import Any

from ..collectives import (
    NUMPY,
    all_gather_direct,
    all_to_all_direct,
    barrier_dissemination,
    broadcast_tree,
    gather_direct,
    scatter_direct,
)
from ..wire import Fingerprint
from .call import Call
from .plan_base import Plan, PlannerBase, Request, _rows_view

__all__ = ["MovementPlans"]

Array = Any


class MovementPlans(PlannerBase):
    """The planner's data movement; see the module docstring."""

    # -- data movement ----------------------------------------------------------------------

    def _broadcast(self, x: Array, request: Request, rank: int, size: int, root: int) -> Plan:
        x, be, dtype = self._array(x, writable=rank != root)
        fp = Fingerprint(
            "broadcast",
            dtype=dtype,
            count=x.size,
            shape=x.shape,
            root=root,
            chunk_bytes=self._chunk,
        )
        shm = self._shm if self._shm is not None and self._shm.claim(be) else None

        async def body(call: Call) -> Array:
            if call.size == 1:
                return x
            if call.rank == root:
                src, copy = self._flat_input(be, x)
                if shm is None or not await shm.broadcast(call, src, root):
                    await broadcast_tree(call, be, src, root)
                self._release(be, copy)
                return x
            buf = self.pool(be).acquire(x.size, x.dtype.newbyteorder("="))
            if shm is None or not await shm.broadcast(call, buf, root):
                await broadcast_tree(call, be, buf, root)
            be.copy_out(buf, x)
            self._release(be, buf)
            return x

        return Plan(fp, body)

    def _all_gather(self, x: Array, request: Request, rank: int, size: int, root: int) -> Plan:
        x, be, dtype = self._array(x)
        rows_x = _rows_view(x)
        fp = Fingerprint("all_gather", dtype=dtype, shape=rows_x.shape[1:], chunk_bytes=self._chunk)
        shm = self._shm if self._shm is not None and self._shm.claim(be) else None

        async def body(call: Call) -> Array:
            block, copy = self._flat_input(be, rows_x)
            rows, trailing = rows_x.shape[0], rows_x.shape[1:]
            result = None
            if shm is not None and call.size > 1:
                result = await shm.all_gather(call, block, rows, trailing)
            if result is None:
                result = await all_gather_direct(call, be, block, rows, trailing)
            self._release(be, copy)
            return result

        return Plan(fp, body, nbytes=x.nbytes)

    def _gather(self, x: Array, request: Request, rank: int, size: int, root: int) -> Plan:
        x, be, dtype = self._array(x)
        rows_x = _rows_view(x)
        fp = Fingerprint(
            "gather", dtype=dtype, shape=rows_x.shape[1:], root=root, chunk_bytes=self._chunk
        )

        async def body(call: Call) -> Array | None:
            block, copy = self._flat_input(be, rows_x)
            result = await gather_direct(call, be, block, rows_x.shape[0], rows_x.shape[1:], root)
            self._release(be, copy)
            return result

        return Plan(fp, body, nbytes=x.nbytes)

    def _scatter(self, x: Array, request: Request, rank: int, size: int, root: int) -> Plan:
        """The root deals the parts of x (non-roots: `_receive_scatter`)."""
        x, be, dtype = self._array(x)
        rows_x = _rows_view(x)
        fp = Fingerprint(
            "scatter",
            dtype=dtype,
            count=x.size,
            shape=rows_x.shape,
            root=root,
            chunk_bytes=self._chunk,
        )

        async def deal(call: Call) -> Array:
            flat, copy = self._flat_input(be, rows_x)
            result = await scatter_direct(call, be, flat, rows_x.shape[0], rows_x.shape[1:], root)
            self._release(be, copy)
            return result

        return Plan(fp, deal)

    def _receive_scatter(self, root: int) -> Plan:
        fp = Fingerprint("scatter", root=root, chunk_bytes=self._chunk)

        async def receive(call: Call) -> Array:
            part = await scatter_direct(call, NUMPY, None, 0, (), root)
            return await self._placement.on_device(part)  # no input: on comm.device

        return Plan(fp, receive)

    def _all_to_all(self, x: Array, request: Request, rank: int, size: int, root: int) -> Plan:
        x, be, dtype = self._array(x)
        rows_x = _rows_view(x)
        fp = Fingerprint("all_to_all", dtype=dtype, shape=rows_x.shape[1:], chunk_bytes=self._chunk)

        async def body(call: Call) -> Array:
            flat, copy = self._flat_input(be, rows_x)
            result = await all_to_all_direct(call, be, flat, rows_x.shape[0], rows_x.shape[1:])
            self._release(be, copy)
            return result

        return Plan(fp, body, nbytes=x.nbytes)

    def _barrier(self) -> Plan:
        shm = self._shm if self._shm is not None and self._shm.claim(NUMPY) else None

        async def body(call: Call) -> None:
            if call.size > 1 and (shm is None or not await shm.barrier(call)):
                await barrier_dissemination(call)

        return Plan(Fingerprint("barrier"), body)
