"""torch's reductions as dsml calls: allreduce, its coalesced form, broadcast, reduce
(adapter layer).

Each function takes a call's arguments, already in dsml's terms (op names, root ranks,
timeouts in seconds), and returns the `Run` that `ProcessGroupDsml` (process_group.py)
starts on the communicator's loop thread. All of them reduce or copy in place: the
outputs are the inputs.
"""

from __future__ import annotations

import numpy as np
import torch

from ..communicator import Communicator
from .mapping import Run, Tensors, _all, _code, _first_other, _flat, _table
from .sparse import all_reduce_sparse

__all__ = ["allreduce", "allreduce_sparse", "allreduce_together", "broadcast", "reduce"]


def allreduce(tensors: Tensors, op: str, timeout: float) -> Run:
    """One dsml all_reduce per tensor, started together."""

    async def run(comm: Communicator) -> Tensors:
        await _all([comm.all_reduce(t, op, timeout=timeout) for t in tensors])
        return tensors

    return run


def allreduce_together(what: str, tensors: Tensors, op: str, timeout: float) -> Run:
    """Several tensors reduced as one: all or none of them change. Concatenated into one
    buffer (so a failure leaves every input as it was, where one all_reduce each would
    have written those that succeeded), after an all_gather of their layout, so that
    tensors of other shapes with the same total fail on every rank."""
    wrong = ""
    if len({(t.dtype, t.device) for t in tensors}) > 1:
        wrong = f"{what}: the tensors must all have one dtype and device"
    layout = _code([(tuple(t.shape), str(t.dtype)) for t in tensors])

    async def run(comm: Communicator) -> Tensors:
        table = await _table(comm, [bool(wrong), layout], timeout)
        if table[:, 0].any():
            bad = int(np.argmax(table[:, 0]))
            raise ValueError(wrong or f"{what}: rank {bad}'s tensors differ in dtype or device")
        other = _first_other(table, 0)
        if other is not None:
            raise ValueError(
                f"{what}: rank {other}'s tensors differ from rank 0's in number, shape or dtype"
            )
        if not tensors:
            return tensors
        flat = torch.cat([_flat(t) for t in tensors])
        await comm.all_reduce(flat, op, timeout=timeout)
        start = 0
        for t in tensors:
            t.copy_(flat[start : start + t.numel()].reshape(t.shape))
            start += t.numel()
        return tensors

    return run


def allreduce_sparse(tensors: Tensors, op: str, timeout: float) -> Run:
    """Sparse COO tensors, one after the other (sparse.py)."""

    async def run(comm: Communicator) -> Tensors:
        for t in tensors:
            await all_reduce_sparse(comm, t, op, timeout)
        return tensors

    return run


def broadcast(tensors: Tensors, root: int, timeout: float) -> Run:
    """One dsml broadcast per tensor, started together."""

    async def run(comm: Communicator) -> Tensors:
        await _all([comm.broadcast(t, root, timeout=timeout) for t in tensors])
        return tensors

    return run


def reduce(tensors: Tensors, root: int, op: str, timeout: float) -> Run:
    """One dsml reduce per tensor, started together; the root's tensors hold the result."""

    async def run(comm: Communicator) -> Tensors:
        await _all([comm.reduce(t, root, op, timeout=timeout) for t in tensors])
        return tensors

    return run
