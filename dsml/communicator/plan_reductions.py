"""Plans of the reductions, and what all_reduce runs (communicator layer).

`choose_all_reduce` is the one place that decides which all_reduce runs: the algorithm
asked for, the same-host shared-memory plane, the hierarchical all_reduce, the `auto`
chooser's cost model across hosts, or the size table (`collectives/select.py`);
`all_reduce_choice` reports what it would choose for `auto` (`comm.all_reduce_choice`).
The plans (plain functions of the communicator's `PlanState`: all_reduce, reduce,
reduce_scatter) check a reduction's arguments (op, algorithm), build its fingerprint,
and return the coroutine that runs it. Results are written into the caller's array only
after the algorithm has succeeded, so a failed call leaves every input intact.
"""

from __future__ import annotations

import math
from typing import Any

from ..collectives import (
    ALL_REDUCE,
    ArrayBackend,
    ReduceOp,
    check_algorithm,
    check_op,
    reduce_scatter_ring,
    reduce_tree,
)
from ..collectives.chunking import split_spans
from ..collectives.cost import Choice
from ..collectives.cost_auto import AutoTicket
from ..collectives.group import Group, wait_receipts
from ..collectives.select import choose_all_reduce as by_size
from ..wire import Fingerprint
from . import stats
from .call import Call
from .plan_base import SHM_ALGORITHMS, Plan, Request, rows_view
from .plan_state import PlanState

__all__ = [
    "all_reduce_choice",
    "choose_all_reduce",
    "plan_all_reduce",
    "plan_reduce",
    "plan_reduce_scatter",
]

Array = Any


def choose_all_reduce(
    state: PlanState, asked: str, be: ArrayBackend, nbytes: int, size: int
) -> tuple[str, AutoTicket | None, bool, bool]:
    """Decide what an all_reduce being planned now (in program order) runs.

    `asked` is the checked `algorithm=` argument. Returns `(algorithm, ticket, in_shm,
    can_hier)`: the algorithm ("shm", "hierarchical" or a TCP one); the `auto` chooser's
    ticket when the cost model decides at the call's start (the algorithm is then
    "auto" until `ticket.resolve`); whether the call runs in shared memory (the whole
    group on this host); whether it may run hierarchical (hosts with as many ranks each).
    Every answer depends on the view, the array's kind and the request only, so every
    rank gives the same. The shared-memory answers take the call's turn on the plane.
    """
    # Shared memory when the whole group is on this host; "shm" asked for elsewhere runs
    # the ring.
    shm = state.shm
    in_shm = shm is not None and asked in ("auto", *SHM_ALGORITHMS) and shm.claim(be)
    # Hosts with as many ranks each: "hierarchical" runs, and auto may choose it.
    can_hier = (
        not in_shm
        and asked in ("auto", "hierarchical")
        and shm is not None
        and shm.claim_hierarchical(be, auto=asked == "auto")
    )
    if asked != "auto":
        return asked, None, in_shm, can_hier
    if in_shm:
        return "shm", None, True, can_hier
    # Across hosts, auto runs what the view's measured cost model picks (agreed by all
    # ranks at the call's start, chunk size included).
    ticket = state.auto.ticket() if state.auto and size > 1 else None
    if ticket is not None:
        return "auto", ticket, False, can_hier
    return by_size(nbytes, size), None, False, can_hier


def all_reduce_choice(state: PlanState, nbytes: int, size: int) -> Choice:
    """What `auto` runs now for a numpy array of nbytes (`comm.all_reduce_choice`)."""
    if state.auto is None:  # a sub-group: the size table, as its plans do
        return Choice(by_size(nbytes, size), state.chunk, float("nan"))
    hierarchical = state.shm is not None and state.shm.weighs_hierarchical()
    return state.auto.choice(nbytes, size, hierarchical)


def plan_all_reduce(
    state: PlanState, x: Array, request: Request, rank: int, size: int, root: int
) -> Plan:
    """Plan an all_reduce in place: what `choose_all_reduce` decides, over a work buffer."""
    x, be, dtype = state.array(x, writable=True)
    op, algorithm = request.op, request.algorithm
    reduce_op, asked = state.memo_get(
        ("all_reduce", dtype, type(op), op, type(algorithm), algorithm),
        lambda: (check_op(op, dtype), check_algorithm(algorithm)),
    )
    algo, ticket, in_shm, can_hier = choose_all_reduce(state, asked, be, x.nbytes, size)
    # the cost model agrees the chunk size at the start: the fingerprint leaves it open
    chunk = None if ticket is not None else state.chunk
    fp = state.memo_get(
        ("fingerprint", dtype, x.shape, reduce_op, algo, chunk),
        lambda: Fingerprint(
            "all_reduce",
            dtype=dtype,
            count=x.size,
            shape=x.shape,
            op=reduce_op.value,
            algorithm=algo,
            chunk_bytes=chunk,
        ),
    )
    shm = state.shm

    async def body(call: Call) -> Array:
        if call.size == 1:
            return x
        group: Group = call
        run = algo
        if ticket is not None:
            group, run = await ticket.resolve(call, x.nbytes, can_hier)
        src, copy = state.flat_input(be, x)
        in_hier = can_hier and run == "hierarchical"
        if can_hier and not in_hier and shm is not None:
            shm.release(call)  # runs over TCP: later shared-memory calls need not wait
        if in_hier and shm is not None:
            await shm.all_reduce_hierarchical(call, src, src, reduce_op)
            done = True
        else:  # False: no room in /dev/shm on some rank; the ring, over TCP
            done = in_shm and shm is not None and await shm.all_reduce(call, src, src, reduce_op)
        if done:
            stats.ran("hierarchical" if in_hier else "shm")
            if copy is not None:
                be.copy_out(copy, x)
            state.release(be, copy)
            return x
        work = state.pool(be).acquire(x.size, src.dtype)
        dst = src if copy is None else work  # x itself when contiguous: no final copy
        tcp = "ring" if run in SHM_ALGORITHMS else run
        stats.ran(tcp)
        pending = await ALL_REDUCE[tcp](group, be, src, work, dst, reduce_op)
        if dst is work:
            be.copy_out(work, x)
        state.pool(be).release(work, pending)
        state.release(be, copy)
        return x

    return Plan(fp, body)


def plan_reduce(
    state: PlanState, x: Array, request: Request, rank: int, size: int, root: int
) -> Plan:
    """Plan a reduce onto root, in place there (a binomial tree)."""
    x, be, dtype = state.array(x, writable=rank == root)
    reduce_op = check_op(request.op, dtype)
    fp = Fingerprint(
        "reduce",
        dtype=dtype,
        count=x.size,
        shape=x.shape,
        op=reduce_op.value,
        root=root,
        chunk_bytes=state.chunk,
    )

    async def body(call: Call) -> Array | None:
        if call.size == 1:
            return x
        src, copy = state.flat_input(be, x)
        out = state.pool(be).acquire(x.size, src.dtype)
        await reduce_tree(call, be, src, out, reduce_op, root)
        if call.rank == root:
            be.copy_out(out, x)
        state.release(be, out, copy)
        return x if call.rank == root else None

    return Plan(fp, body)


def plan_reduce_scatter(
    state: PlanState, x: Array, request: Request, rank: int, size: int, root: int
) -> Plan:
    """Plan a reduce_scatter: rank r gets the reduction of its part (shared memory where it can)."""
    x, be, dtype = state.array(x)
    reduce_op = check_op(request.op, dtype)
    rows_x = rows_view(x)
    fp = Fingerprint(
        "reduce_scatter",
        dtype=dtype,
        count=x.size,
        shape=rows_x.shape,
        op=reduce_op.value,
        chunk_bytes=state.chunk,
    )
    shm = state.shm if state.shm is not None and state.shm.claim(be) else None

    async def body(call: Call) -> Array:
        rows, trailing = rows_x.shape[0], rows_x.shape[1:]
        row_elems = math.prod(trailing)
        row_spans = split_spans(rows, call.size)
        spans = [(lo * row_elems, hi * row_elems) for lo, hi in row_spans]
        src, copy = state.flat_input(be, rows_x)
        if shm is not None and call.size > 1:
            mine = await shm.reduce_scatter(call, src, spans, reduce_op)
            if mine is not None:
                state.release(be, copy)
                lo, hi = row_spans[call.rank]
                return mine.reshape(hi - lo, *trailing)
        out = state.pool(be).acquire(rows_x.size, src.dtype)
        if call.size == 1:
            be.copy(out, 0, len(out), src)
        else:
            scale = _scaler(be, out, reduce_op, call.size)
            sent = await reduce_scatter_ring(call, be, src, out, reduce_op, spans, scale)
            await wait_receipts(sent)  # src may be x, which the caller gets back
        lo, hi = spans[call.rank]
        mine = row_spans[call.rank]
        result = be.empty(hi - lo, src.dtype)  # through the backend: cupy's stream too
        be.copy(result, 0, hi - lo, out[lo:hi])
        result = result.reshape(mine[1] - mine[0], *trailing)
        state.release(be, out, copy)
        return result

    return Plan(fp, body)


def _scaler(be: ArrayBackend, out: Array, op: ReduceOp, size: int) -> Any:
    if op is not ReduceOp.AVG:
        return None

    async def scale(_chunk: int, lo: int, hi: int) -> None:
        be.scale(out, lo, hi, size)

    return scale
