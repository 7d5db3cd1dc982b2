"""A communicator's calls: collectives, point-to-point, engine pushes (communicator layer).

`CommunicatorCalls` is the part of `Communicator` (communicator.py) that starts
operations. Each collective method builds a `Request` and starts it at once (`_start`:
program order is collective order; see `runner.py`) and returns a `CollectiveHandle` to
await. `send` and `recv` are ordered per (source, destination, tag). `push_all_reduce`
and `push_broadcast` push a collective into the dependency engine, issued in push order
on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..collectives.interop import native_arrays, with_native  # torch, JAX, DLPack, buffers
from ..engine import OpHandle, Tagged, Var
from ..errors import ConfigError
from ..wire import Fingerprint
from .call import Call
from .collective_handle import CollectiveHandle
from .comm_info import CommunicatorInfo
from .plans import Request

__all__ = ["CommunicatorCalls"]

Array = Any


class CommunicatorCalls(CommunicatorInfo):
    """The methods that start operations; see the module docstring."""

    # -- collectives ------------------------------------------------------------------------
    # Each method builds a `Request` and starts it (`_start`); see docs/architecture.md.

    @native_arrays(writes=True)
    def all_reduce(
        self, x: Array, op: Any = "sum", *, algorithm: str = "auto", timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Reduce x over all ranks, in place on every rank; the handle gives x."""
        return self._start(Request("all_reduce", x, op=op, algorithm=algorithm, timeout=timeout))

    @native_arrays(writes=True)
    def reduce(
        self, x: Array, root: int = 0, op: Any = "sum", *, timeout: float | None = None
    ) -> CollectiveHandle[Array | None]:
        """Reduce x onto root (in place there); other ranks get None and keep x."""
        return self._start(Request("reduce", x, op=op, root=root, timeout=timeout))

    @native_arrays(writes=True)
    def broadcast(
        self, x: Array, root: int = 0, *, timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Copy root's x into every rank's x (same shape and dtype); the handle gives x."""
        return self._start(Request("broadcast", x, root=root, timeout=timeout))

    @native_arrays(writes=False)
    def all_gather(self, x: Array, *, timeout: float | None = None) -> CollectiveHandle[Array]:
        """Every rank's x concatenated along axis 0 in rank order (a new array)."""
        return self._start(Request("all_gather", x, timeout=timeout))

    @native_arrays(writes=False)
    def gather(
        self, x: Array, root: int = 0, *, timeout: float | None = None
    ) -> CollectiveHandle[Array | None]:
        """Like all_gather, but only root gets the result; others get None."""
        return self._start(Request("gather", x, root=root, timeout=timeout))

    @native_arrays(writes=False)
    def scatter(
        self, x: Array | None = None, root: int = 0, *, timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Rank r receives numpy.array_split(root's x, world_size)[r]; non-roots pass None."""
        return self._start(Request("scatter", x, root=root, timeout=timeout))

    @native_arrays(writes=False)
    def reduce_scatter(
        self, x: Array, op: Any = "sum", *, timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Rank r receives the reduction of numpy.array_split(x, world_size)[r]."""
        return self._start(Request("reduce_scatter", x, op=op, timeout=timeout))

    @native_arrays(writes=False)
    def all_to_all(self, x: Array, *, timeout: float | None = None) -> CollectiveHandle[Array]:
        """Part j of numpy.array_split(x, world_size) goes to rank j; parts received are
        concatenated in rank order."""
        return self._start(Request("all_to_all", x, timeout=timeout))

    def barrier(self, *, timeout: float | None = None) -> CollectiveHandle[None]:
        """Return once every rank has entered the barrier."""
        return self._start(Request("barrier", timeout=timeout))

    def _start(self, request: Request) -> CollectiveHandle[Any]:
        """Start a collective on the communicator's loop: queued behind collectives pushed
        into the engine if some wait to be issued, else at once (`Runner.collective`)."""
        if type(request.x) is not np.ndarray:  # numpy needs no stream
            caller = self._placement.caller_stream(request.x)  # per thread: read it here
            if caller is not None:
                request = dataclasses.replace(request, caller=caller)
        if self._runner.on_own_loop():  # the usual case: no hop to the loop to make
            return self._issue(request)
        return self._runner.on_loop(functools.partial(self._issue, request))

    def _issue(self, request: Request) -> CollectiveHandle[Any]:
        if self._engine_link.must_queue():
            return self._engine_link.queue(request)
        return self._runner.collective(request)

    # -- point to point ---------------------------------------------------------------------

    @native_arrays(writes=False)
    def send(
        self, x: Array, dst: int, *, tag: int = 0, timeout: float | None = None
    ) -> CollectiveHandle[None]:
        """Send x to rank dst; ordered per (source, destination, tag).

        The handle completes once x may be modified again (not when dst has received it).
        """
        caller = self._placement.caller_stream(x)

        def start() -> CollectiveHandle[None]:
            self._views.ensure_current()
            dst_, tag_, fp, send = self._p2p.plan_send(x, dst, tag, caller)
            try:
                budget = self._runner.budget(timeout)
            except ConfigError as exc:  # a bad timeout: refused like a bad array
                self._p2p.refuse(dst_, tag_, str(exc))
                raise
            call = Call(self._table, 0, fp, budget, peer=dst_, tag=tag_)
            what = f"send to rank {dst_} (tag {tag_})"
            hint = f"is rank {dst_} alive and connected?"
            return self._runner.p2p(call, send(call), what, hint)

        return self._runner.on_loop(start)

    def recv(
        self, src: int, *, tag: int = 0, timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Receive the next array rank src sent with this tag (a new array on comm.device)."""

        def start() -> CollectiveHandle[Array]:
            self._views.ensure_current()
            budget = self._runner.budget(timeout)
            peer, tag_ = self._p2p.plan_recv(src, tag)
            call = Call(self._table, 0, Fingerprint("recv"), budget, peer=peer, tag=tag_)
            what = f"recv from rank {peer} (tag {tag_})"
            hint = (
                f"rank {peer} has not sent it: check that it calls send(x, {self.rank}, tag={tag_})"
            )
            return self._runner.p2p(call, self._p2p.receive(call, peer, tag_), what, hint)

        return self._runner.on_loop(start)

    def push_all_reduce(
        self,
        tagged: Tagged[Array],
        op: Any = "sum",
        *,
        read: Iterable[Var] = (),
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> OpHandle[Array]:
        """Push `all_reduce(tagged.data, op)` into the engine; returns the op's handle.

        Two ops are pushed. The first waits for earlier writers of `tagged.var` (and for
        `read`) and for the previous collective to be *issued* (it mutates `comm.var`), then
        starts the all_reduce; the second waits for it to finish and mutates `tagged.var`,
        so later readers of the data see the result. Collectives are thus issued in push
        order on every rank yet several can be in flight. The first op takes its turn even
        if `tagged.var` is poisoned: it then fails the collective on every rank instead of
        leaving the ranks' collective ids out of step. `algorithm` and `timeout` are
        all_reduce's.
        """
        data = tagged.data  # read once: an earlier op may replace it any moment
        return with_native(  # torch, JAX, DLPack data: as for all_reduce
            data,
            True,
            lambda x: self._engine_link.push_collective(
                tagged,
                read,
                Request("all_reduce", x, op=op, algorithm=algorithm, timeout=timeout),
                data,
            ),
        )

    def push_broadcast(
        self, tagged: Tagged[Array], root: int = 0, *, timeout: float | None = None
    ) -> OpHandle[Array]:
        """Push `broadcast(tagged.data, root)` into the engine (see `push_all_reduce`)."""
        data = tagged.data
        return with_native(
            data,
            True,
            lambda x: self._engine_link.push_collective(
                tagged, (), Request("broadcast", x, root=root, timeout=timeout), data
            ),
        )
