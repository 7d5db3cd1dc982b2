"""Validating a collective call and planning its execution (communicator layer).

Each public method checks the caller's arguments on this rank (raising `ConfigError`
before anything is sent), builds the call's fingerprint, and returns the coroutine that
runs it once a `Call` exists. Results are written into the caller's array only after the
algorithm has succeeded, so a failed call leaves every input intact. Plans are made for
numpy arrays; `Placement` (placement.py) adapts them to cupy arrays.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ..collectives import (
    ALL_REDUCE,
    NUMPY,
    ArrayBackend,
    BufferPool,
    ReduceOp,
    all_gather_direct,
    all_to_all_direct,
    backend_of,
    barrier_dissemination,
    broadcast_tree,
    check_algorithm,
    check_op,
    choose_all_reduce,
    dtype_name,
    gather_direct,
    reduce_scatter_ring,
    reduce_tree,
    scatter_direct,
)
from ..collectives.chunking import split_spans
from ..collectives.cost_auto import AutoChooser
from ..collectives.group import Group, wait_receipts
from ..errors import ConfigError
from ..wire import Fingerprint
from . import stats
from .call import Call
from .stats import timed

if TYPE_CHECKING:
    from .placement import Placement
    from .shm_hook import ShmHook

__all__ = ["ROOTED", "SHM_ALGORITHMS", "Plan", "Planner", "Request", "loose_fingerprint"]

SHM_ALGORITHMS = ("shm", "hierarchical")
_MEMO_SIZE = 256  # remembered argument checks and fingerprints per communicator

Array = Any
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Plan:
    """A validated call: its fingerprint, and the coroutine that runs it over a `Call`."""

    fingerprint: Fingerprint
    body: Callable[[Call], Awaitable[Any]]


#: collectives that name a root rank
ROOTED = frozenset({"reduce", "broadcast", "gather", "scatter"})


@dataclass(frozen=True, slots=True)
class Request:
    """One collective call as the user made it, before any check (see `Planner.plan`).

    This is where the caller's arrays enter the communicator: `x` is exactly what the
    public method received (adapters convert before they build a request).
    """

    collective: str
    x: Any = None
    op: Any = None
    root: Any = None
    algorithm: Any = "auto"
    timeout: float | None = None
    caller: Any = None  # the calling thread's CUDA stream, for a cupy x

    def loose_fingerprint(self) -> Fingerprint:
        """A best-effort fingerprint of possibly invalid arguments, sent with the abort
        they cause (see `loose_fingerprint`)."""
        return loose_fingerprint(self.collective, self.x, self.op, self.root)


def loose_fingerprint(
    collective: str, x: object = None, op: object = None, root: object = None
) -> Fingerprint:
    """A best-effort fingerprint of invalid arguments, sent with the abort they cause.

    Only values the wire accepts are kept (short names, integers in range), so the abort
    is not itself refused as malformed by the peers.
    """
    dtype = getattr(x, "dtype", None)
    shape = getattr(x, "shape", None)
    if not (isinstance(shape, tuple) and len(shape) <= 64 and all(_valid_int(d) for d in shape)):
        shape = None
    return Fingerprint(
        collective,
        dtype=_short_name(dtype),
        shape=shape,
        op=_short_name(getattr(op, "value", op)),
        root=root if type(root) is int and _valid_int(root) else None,
    )


def _short_name(value: object) -> str | None:
    text = str(value) if value is not None else ""
    return text if 0 < len(text) <= 64 else None


def _valid_int(value: object) -> bool:
    return type(value) is int and 0 <= value < 1 << 63


def _rows_view(x: Array) -> Array:
    """x with at least one axis (a 0-d array counts as shape (1,))."""
    return x.reshape(1) if x.ndim == 0 else x


class Planner:
    """Plans calls for one communicator; owns its work-buffer pools."""

    def __init__(
        self,
        chunk_bytes: int,
        placement: Placement,
        auto: AutoChooser | None = None,
        shm: ShmHook | None = None,
    ) -> None:
        self._pools: dict[str, BufferPool] = {}
        self._chunk = chunk_bytes  # in every fingerprint: ranks must cut messages alike
        self._placement = placement
        self._auto = auto  # what `auto` runs across hosts (None: the size table)
        self._shm = shm  # the same-host shared-memory plane (shm_hook.py)
        #: what the checks of repeated arguments gave (a training loop repeats a few)
        self._memo: dict[Any, Any] = {}

    def _memo_get(self, key: Any, make: Callable[[], T]) -> T:
        """make(), remembered under `key`: for pure checks and fingerprints, whose result
        depends on the key alone. An unhashable key (an odd op) is simply not kept."""
        try:
            return self._memo[key]  # type: ignore[no-any-return]
        except KeyError:
            pass
        except TypeError:
            return make()
        value = make()  # raises for invalid arguments: errors are not kept
        if len(self._memo) >= _MEMO_SIZE:
            self._memo.clear()
        self._memo[key] = value
        return value

    def pool(self, be: ArrayBackend) -> BufferPool:
        if be.name not in self._pools:
            self._pools[be.name] = BufferPool(be)
        return self._pools[be.name]

    # -- argument checks --------------------------------------------------------------------

    def _array(
        self, x: object, what: str = "x", *, writable: bool = False
    ) -> tuple[Array, ArrayBackend, str]:
        """(x as a plain array sharing its memory, its backend, its dtype's wire name)."""
        be = timed(backend_of(x, what))  # reductions and copies count in comm.stats()
        dtype = x.dtype  # type: ignore[attr-defined]
        name: str = self._memo_get(("dtype", dtype), lambda: dtype_name(dtype))
        if writable and not getattr(x.flags, "writeable", True):  # type: ignore[attr-defined]
            raise ConfigError(f"{what} is read-only, but this collective writes its result into it")
        return be.plain(x), be, name

    @staticmethod
    def _root(root: object, size: int) -> int:
        if type(root) is not int or not 0 <= root < size:
            raise ConfigError(
                f"root={root!r} is not a rank of this group of {size} (0..{size - 1})"
            )
        return root

    def _flat_input(self, be: ArrayBackend, x: Array) -> tuple[Array, Array | None]:
        """A flat contiguous view of x, or a pooled copy (returned second, to release)."""
        view = be.flat_view(x)
        if view is not None:
            return view, None
        buf = self.pool(be).acquire(x.size, x.dtype.newbyteorder("="))
        be.copy_flat(x, buf)
        return buf, buf

    def _release(self, be: ArrayBackend, *bufs: Array | None) -> None:
        for buf in bufs:
            if buf is not None:
                self.pool(be).release(buf)

    # -- one entry point ---------------------------------------------------------------------

    def plan(self, request: Request, rank: int, size: int) -> Plan:
        """Check a call's arguments on this rank and plan it for a group of `size`.

        Raises `ConfigError` before anything is sent. Plans are made for numpy arrays;
        `Placement.place` adapts them to device arrays.
        """
        name = request.collective
        if name == "barrier":
            return self._barrier()
        root = self._root(request.root, size) if name in ROOTED else 0
        if name == "scatter" and rank != root:
            return self._receive_scatter(root)  # non-roots have no input
        x = request.x
        if name == "scatter" and x is None:
            raise ConfigError(f"scatter: the root (rank {root}) must pass the array to scatter")
        x, on_device = self._placement.place(x, request.caller)
        plan: Plan = getattr(self, f"_{name}")(x, request, rank, size, root)
        if on_device is None:
            return plan
        is_root = rank == root
        return on_device.adapt(
            plan,
            needs_input=not (name == "broadcast" and not is_root),  # the others receive all
            writes_back=not (name == "broadcast" and is_root),  # the root's x is unchanged
        )

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
            and shm.claim_hierarchical(be)
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

    # -- data movement ----------------------------------------------------------------------

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

        return Plan(fp, body)

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

        return Plan(fp, body)

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

        return Plan(fp, body)

    def _barrier(self) -> Plan:
        shm = self._shm if self._shm is not None and self._shm.claim(NUMPY) else None

        async def body(call: Call) -> None:
            if call.size > 1 and shm is not None:
                await shm.barrier(call)
            elif call.size > 1:
                await barrier_dissemination(call)

        return Plan(Fingerprint("barrier"), body)


def _scaler(be: ArrayBackend, out: Array, op: ReduceOp, size: int) -> Any:
    if op is not ReduceOp.AVG:
        return None

    async def scale(_chunk: int, lo: int, hi: int) -> None:
        be.scale(out, lo, hi, size)

    return scale
