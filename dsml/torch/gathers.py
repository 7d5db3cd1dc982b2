"""torch's gathering calls as dsml calls: allgather (into lists, into one tensor, and
coalesced), gather and scatter (adapter layer).

Each function takes a call's arguments in torch's list layout (after the overloads are
made one in process_group.py) and returns the `Run` that `ProcessGroupDsml` starts on
the communicator's loop thread. What is wrong with a rank's own arguments is found here,
before the call; gather and scatter first all_gather every rank's sizes (`_table`), since
there only the root can see that another rank's tensor does not fit.
"""

from __future__ import annotations

import torch

from ..communicator import Communicator
from .mapping import (
    Run,
    Tensors,
    _all,
    _code,
    _copy_into,
    _first_other,
    _flat,
    _gather_outputs_wrong,
    _refuse,
    _split_into,
    _table,
    _unequal,
)

__all__ = ["allgather", "allgather_coalesced", "allgather_into_tensors", "gather", "scatter"]


def allgather(size: int, outputs: list[Tensors], inputs: Tensors, timeout: float) -> Run:
    """`outputs[i][r]` is rank r's `inputs[i]`: one dsml all_gather per input."""
    wrong = _gather_outputs_wrong(size, outputs, inputs)

    async def run(comm: Communicator) -> list[Tensors]:
        if wrong:
            await _refuse(comm, len(inputs), ValueError(f"allgather: {wrong}"))
        handles = [comm.all_gather(_flat(x), timeout=timeout) for x in inputs]
        for parts, gathered in zip(outputs, await _all(handles), strict=True):
            _split_into(parts, gathered)
        return outputs

    return run


def allgather_into_tensors(size: int, outputs: Tensors, inputs: Tensors, timeout: float) -> Run:
    """`outputs[i]` holds every rank's `inputs[i]` in rank order (all_gather_into_tensor)."""
    wrong = _gather_outputs_wrong(size, [[o] for o in outputs], inputs, whole=True)

    async def run(comm: Communicator) -> Tensors:
        if wrong:
            await _refuse(comm, len(inputs), ValueError(f"all_gather_into_tensor: {wrong}"))
        handles = [comm.all_gather(_flat(x), timeout=timeout) for x in inputs]
        for out, gathered in zip(outputs, await _all(handles), strict=True):
            _copy_into(out, gathered)
        return outputs

    return run


def allgather_coalesced(size: int, outputs: list[Tensors], inputs: Tensors, timeout: float) -> Run:
    """`outputs[r][i]` is rank r's `inputs[i]`: one all_gather of the inputs joined."""
    wrong = _coalesced_outputs_wrong(size, outputs, inputs)

    async def run(comm: Communicator) -> list[Tensors]:
        if wrong:
            await _refuse(comm, 1, ValueError(f"allgather_coalesced: {wrong}"))
        if not inputs:
            return outputs
        whole = torch.cat([_flat(x) for x in inputs])
        gathered = await comm.all_gather(whole, timeout=timeout)
        _split_into([o for outs in outputs for o in outs], gathered)
        return outputs

    return run


def _coalesced_outputs_wrong(size: int, outputs: list[Tensors], inputs: Tensors) -> str:
    """Why `outputs` (one list per rank) cannot hold every rank's `inputs`, or ""."""
    if len(outputs) != size:
        return f"{len(outputs)} output lists for a group of {size}"
    if len({t.dtype for t in inputs}) > 1:
        return "the inputs must all have one dtype"
    for outs in outputs:
        if len(outs) != len(inputs):
            return f"an output list has {len(outs)} tensors for {len(inputs)} inputs"
        wrong = _gather_outputs_wrong(1, [[o] for o in outs], inputs)
        if wrong:
            return wrong
    return ""


def gather(
    rank: int, size: int, outputs: list[Tensors], inputs: Tensors, root: int, timeout: float
) -> Run:
    """The root's `outputs[0][r]` is rank r's `inputs[0]`."""
    x = inputs[0]
    wrong = _gather_outputs_wrong(size, outputs, inputs) if rank == root else ""

    async def run(comm: Communicator) -> list[Tensors]:
        # Every rank learns every input's size and dtype and whether the root's outputs
        # fit: an error on one rank is an error on all (the root alone could tell).
        table = await _table(comm, [bool(wrong), x.numel(), _code(x.dtype)], timeout)
        if table[root, 0]:
            raise ValueError(f"gather: {wrong or f'rank {root} has wrong outputs'}")
        other = _first_other(table, root)
        if other is not None:
            raise ValueError(
                f"gather: rank {other}'s input ({table[other, 1]} elements) differs in size "
                f"or dtype from rank {root}'s ({table[root, 1]}): every rank's input must "
                "match one output"
            )
        gathered = await comm.gather(_flat(x), root, timeout=timeout)
        if gathered is not None:
            _split_into(outputs[0], gathered)
        return outputs

    return run


def scatter(
    rank: int, size: int, outputs: Tensors, inputs: list[Tensors], root: int, timeout: float
) -> Run:
    """Rank r's `outputs[0]` gets the root's `inputs[0][r]`."""
    parts, out = (inputs[0] if inputs else None), outputs[0]
    wrong = _unequal("scatter", parts, size) if parts is not None else ""
    if rank == root and parts is None:
        wrong = "scatter: the root has no parts to scatter"
    part = parts[0] if parts and not wrong else out  # what every output must match

    async def run(comm: Communicator) -> Tensors:
        # Every rank learns whether the root's parts fit every rank's output, so a
        # wrong output on one rank is an error on all (not that rank alone).
        mine = [bool(wrong), out.numel(), _code(out.dtype), part.numel(), _code(part.dtype)]
        table = await _table(comm, mine, timeout)
        if table[root, 0]:
            raise ValueError(wrong or f"scatter: rank {root} has wrong parts")
        for r in range(len(table)):
            if table[r, 1] != table[root, 3] or table[r, 2] != table[root, 4]:
                raise ValueError(
                    f"scatter: rank {r}'s output ({table[r, 1]} elements) does not match "
                    f"the parts of rank {root} ({table[root, 3]} elements) in size or dtype"
                )
        whole = torch.cat([_flat(p) for p in parts]) if parts is not None else None
        _copy_into(out, await comm.scatter(whole, root, timeout=timeout))
        return outputs

    return run
