"""Plans of the collectives that move data without reducing it (communicator layer).

One plain function per collective (broadcast, all_gather, gather, scatter, all_to_all,
barrier), of the communicator's `PlanState`: each checks its arguments, builds its
fingerprint, and returns the coroutine that runs it, over the same-host shared-memory
plane where it has a path for that collective (shm_hook.py), else over TCP. Results that
land in the caller's array (broadcast) are written only after the algorithm has
succeeded.
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
from .plan_base import Plan, Request, rows_view
from .plan_state import PlanState

__all__ = [
    "plan_all_gather",
    "plan_all_to_all",
    "plan_barrier",
    "plan_broadcast",
    "plan_gather",
    "plan_receive_scatter",
    "plan_scatter",
]

Array = Any


def plan_broadcast(
    state: PlanState, x: Array, request: Request, rank: int, size: int, root: int
) -> Plan:
    """Plan a broadcast of root's x into every rank's x (shared memory where it can)."""
    x, be, dtype = state.array(x, writable=rank != root)
    fp = Fingerprint(
        "broadcast",
        dtype=dtype,
        count=x.size,
        shape=x.shape,
        root=root,
        chunk_bytes=state.chunk,
    )
    shm = state.shm if state.shm is not None and state.shm.claim(be) else None

    async def body(call: Call) -> Array:
        if call.size == 1:
            return x
        if call.rank == root:
            src, copy = state.flat_input(be, x)
            if shm is None or not await shm.broadcast(call, src, root):
                await broadcast_tree(call, be, src, root)
            state.release(be, copy)
            return x
        buf = state.pool(be).acquire(x.size, x.dtype.newbyteorder("="))
        if shm is None or not await shm.broadcast(call, buf, root):
            await broadcast_tree(call, be, buf, root)
        be.copy_out(buf, x)
        state.release(be, buf)
        return x

    return Plan(fp, body)


def plan_all_gather(
    state: PlanState, x: Array, request: Request, rank: int, size: int, root: int
) -> Plan:
    """Plan an all_gather of every rank's rows (shared memory where it can)."""
    x, be, dtype = state.array(x)
    rows_x = rows_view(x)
    fp = Fingerprint("all_gather", dtype=dtype, shape=rows_x.shape[1:], chunk_bytes=state.chunk)
    shm = state.shm if state.shm is not None and state.shm.claim(be) else None

    async def body(call: Call) -> Array:
        block, copy = state.flat_input(be, rows_x)
        rows, trailing = rows_x.shape[0], rows_x.shape[1:]
        result = None
        if shm is not None and call.size > 1:
            result = await shm.all_gather(call, block, rows, trailing)
        if result is None:
            result = await all_gather_direct(call, be, block, rows, trailing)
        state.release(be, copy)
        return result

    return Plan(fp, body, nbytes=x.nbytes)


def plan_gather(
    state: PlanState, x: Array, request: Request, rank: int, size: int, root: int
) -> Plan:
    """Plan a gather of every rank's rows onto root."""
    x, be, dtype = state.array(x)
    rows_x = rows_view(x)
    fp = Fingerprint(
        "gather", dtype=dtype, shape=rows_x.shape[1:], root=root, chunk_bytes=state.chunk
    )

    async def body(call: Call) -> Array | None:
        block, copy = state.flat_input(be, rows_x)
        result = await gather_direct(call, be, block, rows_x.shape[0], rows_x.shape[1:], root)
        state.release(be, copy)
        return result

    return Plan(fp, body, nbytes=x.nbytes)


def plan_scatter(
    state: PlanState, x: Array, request: Request, rank: int, size: int, root: int
) -> Plan:
    """Plan a scatter on its root, which deals the parts of x (non-roots:
    `plan_receive_scatter`)."""
    x, be, dtype = state.array(x)
    rows_x = rows_view(x)
    fp = Fingerprint(
        "scatter",
        dtype=dtype,
        count=x.size,
        shape=rows_x.shape,
        root=root,
        chunk_bytes=state.chunk,
    )

    async def deal(call: Call) -> Array:
        flat, copy = state.flat_input(be, rows_x)
        result = await scatter_direct(call, be, flat, rows_x.shape[0], rows_x.shape[1:], root)
        state.release(be, copy)
        return result

    return Plan(fp, deal)


def plan_receive_scatter(state: PlanState, root: int) -> Plan:
    """Plan a non-root's part of a scatter (it has no input)."""
    fp = Fingerprint("scatter", root=root, chunk_bytes=state.chunk)

    async def receive(call: Call) -> Array:
        part = await scatter_direct(call, NUMPY, None, 0, (), root)
        return await state.placement.on_device(part)  # no input: on comm.device

    return Plan(fp, receive)


def plan_all_to_all(
    state: PlanState, x: Array, request: Request, rank: int, size: int, root: int
) -> Plan:
    """Plan an all_to_all: part j of x to rank j."""
    x, be, dtype = state.array(x)
    rows_x = rows_view(x)
    fp = Fingerprint("all_to_all", dtype=dtype, shape=rows_x.shape[1:], chunk_bytes=state.chunk)

    async def body(call: Call) -> Array:
        flat, copy = state.flat_input(be, rows_x)
        result = await all_to_all_direct(call, be, flat, rows_x.shape[0], rows_x.shape[1:])
        state.release(be, copy)
        return result

    return Plan(fp, body, nbytes=x.nbytes)


def plan_barrier(state: PlanState) -> Plan:
    """Plan a barrier (shared memory where it can)."""
    shm = state.shm if state.shm is not None and state.shm.claim(NUMPY) else None

    async def body(call: Call) -> None:
        if call.size > 1 and (shm is None or not await shm.barrier(call)):
            await barrier_dissemination(call)

    return Plan(Fingerprint("barrier"), body)
