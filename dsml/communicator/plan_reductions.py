"""Plans of the reductions: all_reduce, reduce, reduce_scatter (communicator layer).

`ReductionPlans` checks a reduction's arguments (op, algorithm), builds its fingerprint,
and returns the coroutine that runs it: over the same-host shared-memory plane when the
group can use it (shm_hook.py), else over the algorithm the request or `auto` chose.
Results are written into the caller's array only after the algorithm has succeeded, so a
failed call leaves every input intact. `choose_algorithm` is where `auto` is decided.
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
    choose_all_reduce,
    reduce_scatter_ring,
    reduce_tree,
)
from ..collectives.chunking import split_spans
from ..collectives.group import Group, wait_receipts
from ..wire import Fingerprint
from . import stats
from .call import Call
from .plan_base import SHM_ALGORITHMS, Plan, PlannerBase, Request, _rows_view

__all__ = ["ReductionPlans"]

Array = Any


class ReductionPlans(PlannerBase):
    """The planner's reductions; see the module docstring."""

    def choose_algorithm(self, algorithm: Any, nbytes: int, size: int) -> str:
        """The all_reduce algorithm to run: the one asked for, or the choice for `auto`
        (the place where a cost model plugs in)."""
        algo = check_algorithm(algorithm)
        return choose_all_reduce(nbytes, size) if algo == "auto" else algo

    # -- reductions in place ----------------------------------------------------------------

    def _all_reduce(self, x: Array, request: Request, rank: int, size: int, root: int) -> Plan:
        x, be, dtype = self._array(x, writable=True)
        op, algorithm = request.op, request.algorithm
        reduce_op, asked = self._memo_get(
            ("all_reduce", dtype, type(op), op, type(algorithm), algorithm),
            lambda: (check_op(op, dtype), check_algorithm(algorithm)),
        )
        # Shared memory when the whole group is on this host (the same answer on every
        # rank: it depends on the view only); "shm" asked for elsewhere runs the ring.
        shm = self._shm
        in_shm = shm is not None and asked in ("auto", *SHM_ALGORITHMS) and shm.claim(be)
        # Hosts with as many ranks each: "hierarchical" runs, and auto may choose it.
        can_hier = (
            not in_shm
            and asked in ("auto", "hierarchical")
            and shm is not None
            and shm.claim_hierarchical(be, auto=asked == "auto")
        )
        hier = asked == "hierarchical" and can_hier
        # Across hosts, auto runs what the view's measured cost model picks (agreed by all
        # ranks, chunk size included, so the fingerprint leaves the chunk open).
        algo, ticket = asked, None
        if in_shm and asked == "auto":
            algo = "shm"
        elif algo == "auto" and self._auto and size > 1:
            ticket = self._auto.ticket()
        if ticket is None:
            algo = self.choose_algorithm(algo, x.nbytes, size)
        chunk = None if ticket is not None else self._chunk
        fp = self._memo_get(
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

        async def body(call: Call) -> Array:
            if call.size == 1:
                return x
            group: Group = call
            run = algo
            if ticket is not None:
                group, run = await ticket.resolve(call, x.nbytes, can_hier)
            src, copy = self._flat_input(be, x)
            in_hier = hier or (can_hier and run == "hierarchical")
            if can_hier and not in_hier and shm is not None:
                shm.release(call)  # runs over TCP: later shared-memory calls need not wait
            if in_hier and shm is not None:
                await shm.all_reduce_hierarchical(call, src, src, reduce_op)
                done = True
            else:  # False: no room in /dev/shm on some rank; the ring, over TCP
                done = (
                    in_shm and shm is not None and await shm.all_reduce(call, src, src, reduce_op)
                )
            if done:
                stats.ran("hierarchical" if in_hier else "shm")
                if copy is not None:
                    be.copy_out(copy, x)
                self._release(be, copy)
                return x
            work = self.pool(be).acquire(x.size, src.dtype)
            dst = src if copy is None else work  # x itself when contiguous: no final copy
            tcp = "ring" if run in SHM_ALGORITHMS else run
            stats.ran(tcp)
            pending = await ALL_REDUCE[tcp](group, be, src, work, dst, reduce_op)
            if dst is work:
                be.copy_out(work, x)
            self.pool(be).release(work, pending)
            self._release(be, copy)
            return x

        return Plan(fp, body)

    def _reduce(self, x: Array, request: Request, rank: int, size: int, root: int) -> Plan:
        x, be, dtype = self._array(x, writable=rank == root)
        reduce_op = check_op(request.op, dtype)
        fp = Fingerprint(
            "reduce",
            dtype=dtype,
            count=x.size,
            shape=x.shape,
            op=reduce_op.value,
            root=root,
            chunk_bytes=self._chunk,
        )

        async def body(call: Call) -> Array | None:
            if call.size == 1:
                return x
            src, copy = self._flat_input(be, x)
            out = self.pool(be).acquire(x.size, src.dtype)
            await reduce_tree(call, be, src, out, reduce_op, root)
            if call.rank == root:
                be.copy_out(out, x)
            self._release(be, out, copy)
            return x if call.rank == root else None

        return Plan(fp, body)

    def _reduce_scatter(self, x: Array, request: Request, rank: int, size: int, root: int) -> Plan:
        x, be, dtype = self._array(x)
        reduce_op = check_op(request.op, dtype)
        rows_x = _rows_view(x)
        fp = Fingerprint(
            "reduce_scatter",
            dtype=dtype,
            count=x.size,
            shape=rows_x.shape,
            op=reduce_op.value,
            chunk_bytes=self._chunk,
        )
        shm = self._shm if self._shm is not None and self._shm.claim(be) else None

        async def body(call: Call) -> Array:
            rows, trailing = rows_x.shape[0], rows_x.shape[1:]
            row_elems = math.prod(trailing)
            row_spans = split_spans(rows, call.size)
            spans = [(lo * row_elems, hi * row_elems) for lo, hi in row_spans]
            src, copy = self._flat_input(be, rows_x)
            if shm is not None and call.size > 1:
                mine = await shm.reduce_scatter(call, src, spans, reduce_op)
                if mine is not None:
                    self._release(be, copy)
                    lo, hi = row_spans[call.rank]
                    return mine.reshape(hi - lo, *trailing)
            out = self.pool(be).acquire(rows_x.size, src.dtype)
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
            self._release(be, out, copy)
            return result

        return Plan(fp, body)


def _scaler(be: ArrayBackend, out: Array, op: ReduceOp, size: int) -> Any:
    if op is not ReduceOp.AVG:
        return None

    async def scale(_chunk: int, lo: int, hi: int) -> None:
        be.scale(out, lo, hi, size)

    return scale
