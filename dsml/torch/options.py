"""torch's call forms for a ProcessGroup, made one (adapter layer).

torch binds each ProcessGroup method with overloads: the list-and-options form its own
Python API and C++ (DDP's reducer) use, `pg.allreduce([t])` with the options omitted, and
the tensor-and-argument forms (`pg.allreduce(t, ReduceOp.MAX)`, `pg.broadcast(t, 0)`,
`pg.barrier(timedelta(...))`). A Python subclass receives whichever the caller wrote; the
helpers here turn every form into torch's options object with torch's defaults, so that
`ProcessGroupDsml` (process_group.py) reads `opts.reduceOp`, `opts.rootRank` and
`opts.timeout` whatever was passed.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

__all__ = ["OPTIONS", "options", "tensor_list"]

#: torch's options class of each call, built with torch's defaults when omitted
OPTIONS: dict[str, Any] = {
    "allreduce": c10d.AllreduceOptions,
    "allreduce_coalesced": c10d.AllreduceCoalescedOptions,
    "broadcast": c10d.BroadcastOptions,
    "reduce": c10d.ReduceOptions,
    "allgather": c10d.AllgatherOptions,
    "gather": c10d.GatherOptions,
    "scatter": c10d.ScatterOptions,
    "reduce_scatter": c10d.ReduceScatterOptions,
    "alltoall": c10d.AllToAllOptions,
    "barrier": c10d.BarrierOptions,
}

T = TypeVar("T")


def options(call: str, given: Any = None, **fields: Any) -> Any:
    """torch's options for `call` from what the caller passed in the options' place.

    `given` is an options object (used as it is), None (torch's defaults), a timedelta
    (the timeout), a ReduceOp (the op) or an int (the root rank), as torch's overloads
    take them. `fields` are the overloads' later arguments (`op`, `root`, `timeout`);
    those left None keep the default.
    """
    cls = OPTIONS[call]
    if isinstance(given, cls):
        if all(v is None for v in fields.values()):
            return given
        opts = _copy(given, cls)
    else:
        opts = cls()
        if isinstance(given, timedelta):
            fields["timeout"] = fields.get("timeout") or given
        elif isinstance(given, dist.ReduceOp | dist.ReduceOp.RedOpType):
            fields["op"] = given
        elif isinstance(given, int) and not isinstance(given, bool):
            fields["root"] = given
        elif given is not None:
            raise TypeError(
                f"{call}: options of type {type(given).__name__} are not {cls.__name__}"
            )
    names = {"op": "reduceOp", "root": "rootRank", "timeout": "timeout"}
    for name, value in fields.items():
        if value is not None:
            setattr(opts, names[name], value)
    return opts


def _copy(opts: Any, cls: Any) -> Any:
    """A copy of an options object (torch's are mutable and may be shared)."""
    new = cls()
    for name in ("reduceOp", "rootRank", "rootTensor", "timeout", "asyncOp"):
        if hasattr(opts, name):
            setattr(new, name, getattr(opts, name))
    return new


def tensor_list(x: torch.Tensor | list[T] | tuple[T, ...]) -> list[Any]:
    """[x] for one tensor (the tensor overloads), else x as a list."""
    return [x] if isinstance(x, torch.Tensor) else list(x)
