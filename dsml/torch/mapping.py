"""How torch's arguments map onto dsml's calls (adapter layer).

Helpers of `ProcessGroupDsml` (process_group.py): torch's reduce ops as dsml's op names,
tensors flattened where torch's layout is a list of equal parts, results that are new
arrays copied into the caller's output tensors, awaiting several handles at once, and
all-to-all with uneven split sizes as a padded all-to-all.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..collectives.interop import like
from ..communicator import Communicator

__all__ = ["Run", "Tensors"]

Tensors = list[torch.Tensor]
#: one torch call as dsml calls: run on the communicator's loop thread, returns the outputs
Run = Callable[[Communicator], Coroutine[Any, Any, Any]]
_OPS = (
    (dist.ReduceOp.SUM, "sum"),
    (dist.ReduceOp.AVG, "avg"),
    (dist.ReduceOp.PRODUCT, "prod"),
    (dist.ReduceOp.MIN, "min"),
    (dist.ReduceOp.MAX, "max"),
    (dist.ReduceOp.BAND, "band"),
    (dist.ReduceOp.BOR, "bor"),
    (dist.ReduceOp.BXOR, "bxor"),
)
_UNSET_TIMEOUT_S = 0.0


def _op_name(op: Any) -> str:
    for torch_op, name in _OPS:
        if op == torch_op:
            return name
    shown = getattr(getattr(op, "op", op), "name", op)  # ReduceOp objects print an address
    raise ValueError(
        f"the dsml backend supports ReduceOp SUM, AVG, PRODUCT, MIN and MAX, not {shown}"
    )


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
    timeout: float,  # noqa: ASYNC109 (each call takes it)
) -> None:
    """Send parts[j] to rank j and receive rank j's part into outputs[j] (all-to-all with
    uneven sizes), as two collectives every rank makes alike, whatever its sizes:

    1. an all_gather of every rank's part sizes, sent and expected: every rank checks the
       whole matrix, so a mismatch is a ValueError on every rank (not a hang);
    2. an all_to_all of the parts padded to the longest part anywhere.
    """
    world = comm.world_size
    if len(parts) != world or len(outputs) != world:
        raise ValueError(
            f"all_to_all: {len(parts)} input and {len(outputs)} output parts in a group of {world}"
        )
    table = await _table(comm, [p.numel() for p in parts] + [o.numel() for o in outputs], timeout)
    sent, expected = table[:, :world], table[:, world:]
    if not np.array_equal(sent, expected.T):
        i, j = (int(v) for v in np.argwhere(sent != expected.T)[0])
        raise ValueError(
            f"all_to_all: rank {i} sends {sent[i, j]} elements to rank {j}, which expects "
            f"{expected[j, i]} (split sizes must agree between sender and receiver)"
        )
    longest = max(int(sent.max()), 1)
    first = parts[0]
    padded = torch.zeros(world * longest, dtype=first.dtype, device=first.device)
    for j, part in enumerate(parts):
        padded[j * longest : j * longest + part.numel()] = part.reshape(-1)
    got = await comm.all_to_all(padded, timeout=timeout)
    tensor = got if isinstance(got, torch.Tensor) else like(got, outputs[0])
    for j, out in enumerate(outputs):
        _copy_into(out, tensor[j * longest : j * longest + out.numel()])


def _reduce_op(opts: Any) -> Any:
    return opts if isinstance(opts, dist.ReduceOp | dist.ReduceOp.RedOpType) else opts.reduceOp


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)  # a view when it can be: dsml reads strided tensors too


def _unequal(what: str, parts: Tensors, world: int) -> str:
    """Why a list of parts (one per rank) is wrong, or ""."""
    if len(parts) != world:
        return f"{what}: {len(parts)} parts for a group of {world}"
    if len({p.numel() for p in parts}) > 1:
        return f"{what}: the dsml backend needs parts of equal size"
    return ""


def _gather_outputs_wrong(
    world: int, outputs: list[Tensors], inputs: Tensors, *, whole: bool = False
) -> str:
    """Why outputs (one list per input) cannot hold the gathered inputs, or ""."""
    for outs, x in zip(outputs, inputs, strict=True):
        if not whole and len(outs) != world:
            return f"{len(outs)} outputs for a group of {world}"
        need = x.numel() * (world if whole else 1)
        for out in outs:
            if out.numel() != need:
                return f"an output has {out.numel()} elements, the input {x.numel()}" + (
                    f" (x {world} ranks)" if whole else ""
                )
            if out.dtype != x.dtype:
                return f"an output is {out.dtype}, the input {x.dtype}"
    return ""


def _copy_into(out: torch.Tensor, value: Any) -> None:
    """out[...] = value (a torch tensor, or a numpy/cupy array from a call without input):
    same number of elements and dtype, as gloo requires (copy_ would cast silently)."""
    tensor = value if isinstance(value, torch.Tensor) else like(value, out)
    if tensor.dtype != out.dtype:
        raise ValueError(f"the output is {out.dtype}, the data {tensor.dtype}")
    if tensor.numel() != out.numel():
        raise ValueError(f"the output has {out.numel()} elements, the data {tensor.numel()}")
    out.copy_(tensor.reshape(out.shape))


def _split_into(outs: Tensors, gathered: Any) -> None:
    """Copy equal parts of `gathered` into outs, which must cover it exactly."""
    tensor = gathered if isinstance(gathered, torch.Tensor) else like(gathered, outs[0])
    total = sum(out.numel() for out in outs)
    if total != tensor.numel():
        raise ValueError(
            f"{len(outs)} outputs of {total} elements in all for {tensor.numel()} gathered "
            "(every rank's input must have the size of one output)"
        )
    start = 0
    for out in outs:
        _copy_into(out, tensor[start : start + out.numel()])
        start += out.numel()


def _code(what: object) -> int:
    """A number for a dtype (or a tensors' layout) that every rank computes alike (for
    `_table`)."""
    return zlib.crc32(repr(what).encode())


async def _table(
    comm: Communicator,
    row: Sequence[int],
    timeout: float,  # noqa: ASYNC109 (each call takes it)
) -> np.ndarray:
    """Every rank's `row` (a few ints of the same length everywhere), one row per rank:
    an all_gather, so that a check that needs the others' arguments (sizes, dtypes, a
    flag that some rank's own arguments are wrong) fails alike on every rank."""
    mine = np.asarray(row, dtype=np.int64)
    got = await comm.all_gather(mine, timeout=timeout)
    return np.asarray(got).reshape(comm.world_size, len(mine))


def _first_other(table: np.ndarray, ref: int) -> int | None:
    """The first rank whose row differs from rank `ref`'s, or None."""
    for r in range(len(table)):
        if not np.array_equal(table[r], table[ref]):
            return r
    return None


async def _refuse(comm: Communicator, calls: int, error: BaseException) -> None:
    """A call this rank cannot make (its arguments are wrong): take the turns of the
    `calls` collectives it would have made with barriers, which the peers' calls do not
    match, so they fail at once with a mismatch instead of waiting for their timeout;
    then raise `error` here."""
    await asyncio.gather(*(comm.barrier() for _ in range(calls)), return_exceptions=True)
    raise error
