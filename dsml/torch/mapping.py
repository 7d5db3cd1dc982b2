"""How torch's arguments map onto dsml's calls (adapter layer).

Helpers of `ProcessGroupDsml` (process_group.py): torch's reduce ops as dsml's op names,
tensors flattened where torch's layout is a list of equal parts, results that are new
arrays copied into the caller's output tensors, awaiting several handles at once, and
all-to-all with uneven split sizes as a send/recv to each peer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..collectives.interop import like
from ..communicator import Communicator

__all__ = ["Tensors"]

Tensors = list[torch.Tensor]
_UNEVEN_TAG = (1 << 31) - 1  # the tag of alltoall's send/recv pairs (uneven splits)
_OPS = (
    (dist.ReduceOp.SUM, "sum"),
    (dist.ReduceOp.AVG, "avg"),
    (dist.ReduceOp.PRODUCT, "prod"),
    (dist.ReduceOp.MIN, "min"),
    (dist.ReduceOp.MAX, "max"),
)
_UNSET_TIMEOUT_S = 0.0


def _op_name(op: Any) -> str:
    for torch_op, name in _OPS:
        if op == torch_op:
            return name
    raise ValueError(f"the dsml backend supports ReduceOp SUM, AVG, PRODUCT, MIN and MAX, not {op}")


async def _all(handles: Sequence[Awaitable[Any]]) -> list[Any]:
    """Await every handle (all of them, even after one failed); their results in order."""
    outcomes = await asyncio.gather(*handles, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return outcomes


async def _exchange(
    comm: Communicator,
    parts: Tensors,
    outputs: Tensors,
    timeout: float,  # noqa: ASYNC109 (each send and recv takes it)
) -> None:
    """Send parts[j] to rank j and receive rank j's part into outputs[j] (uneven all-to-all)."""
    rank = comm.rank
    outputs[rank].view(-1).copy_(parts[rank])
    peers = [j for j in range(comm.world_size) if j != rank]
    sends = [comm.send(parts[j], j, tag=_UNEVEN_TAG, timeout=timeout) for j in peers]
    received = await _all([comm.recv(j, tag=_UNEVEN_TAG, timeout=timeout) for j in peers])
    for j, part in zip(peers, received, strict=True):
        _copy_into(outputs[j], part)
    await _all(sends)


def _reduce_op(opts: Any) -> Any:
    return opts if isinstance(opts, dist.ReduceOp | dist.ReduceOp.RedOpType) else opts.reduceOp


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)  # a view when it can be: dsml reads strided tensors too


def _check_equal(what: str, parts: Tensors) -> None:
    if len({p.numel() for p in parts}) > 1:
        raise ValueError(f"{what}: the dsml backend needs parts of equal size")


def _copy_into(out: torch.Tensor, value: Any) -> None:
    """out[...] = value (a torch tensor, or a numpy/cupy array from a call without input)."""
    tensor = value if isinstance(value, torch.Tensor) else like(value, out)
    out.copy_(tensor.reshape(out.shape))


def _split_into(outs: Tensors, gathered: Any) -> None:
    tensor = gathered if isinstance(gathered, torch.Tensor) else like(gathered, outs[0])
    start = 0
    for out in outs:
        out.copy_(tensor[start : start + out.numel()].reshape(out.shape))
        start += out.numel()
