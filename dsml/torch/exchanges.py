"""torch's reduce-scatter and all-to-all calls as dsml calls (adapter layer).

Each function takes a call's arguments, the inputs already flattened where torch's layout
is a list of equal parts, and returns the `Run` that `ProcessGroupDsml`
(process_group.py) starts on the communicator's loop thread. all-to-all with uneven split
sizes is a padded all-to-all (`_exchange`, mapping.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..communicator import Communicator
from .mapping import Run, Tensors, _all, _copy_into, _exchange, _flat, _refuse, _unequal

__all__ = ["alltoall", "alltoall_single", "reduce_scatter", "reduce_scatter_parts"]


def reduce_scatter_parts(size: int, inputs: list[Tensors]) -> tuple[Tensors, str]:
    """torch's list-of-parts inputs (one list per output) joined into one tensor each,
    and why the parts are wrong ("" when they are not)."""
    wrong = next(filter(None, (_unequal("reduce_scatter", p, size) for p in inputs)), "")
    return [torch.cat([_flat(p) for p in parts]) for parts in inputs], wrong


def reduce_scatter(
    what: str,
    size: int,
    outputs: Tensors,
    wholes: Tensors,
    op: str,
    timeout: float,
    wrong: str = "",
) -> Run:
    """Rank r's `outputs[i]` gets the reduction of part r of every rank's `wholes[i]`."""
    for out, whole in zip(outputs, wholes, strict=True):
        if not wrong and whole.numel() != out.numel() * size:
            wrong = (
                f"{what}: the input has {whole.numel()} elements; it needs world size "
                f"({size}) x the output's {out.numel()}"
            )
        if not wrong and whole.dtype != out.dtype:
            wrong = f"{what}: the output is {out.dtype}, the input {whole.dtype}"

    async def run(comm: Communicator) -> Tensors:
        if wrong:
            await _refuse(comm, len(wholes), ValueError(wrong))
        handles = [comm.reduce_scatter(w, op, timeout=timeout) for w in wholes]
        for out, mine in zip(outputs, await _all(handles), strict=True):
            _copy_into(out, mine)
        return outputs

    return run


def alltoall(size: int, outputs: Tensors, inputs: Tensors, timeout: float) -> Run:
    """`inputs[j]` goes to rank j; `outputs[j]` gets rank j's part (sizes may differ)."""
    wrong = ""
    if len(inputs) != size or len(outputs) != size:
        wrong = (
            f"all_to_all: {len(inputs)} input and {len(outputs)} output parts in a group of {size}"
        )

    async def run(comm: Communicator) -> Tensors:
        if wrong:  # one barrier: the peers fail at the first of their two collectives
            await _refuse(comm, 1, ValueError(wrong))
        # Always the same two collectives, whatever this rank's sizes: choosing by them
        # (equal parts: one all_to_all) let ranks take different paths and hang.
        await _exchange(comm, [_flat(t) for t in inputs], outputs, timeout)
        return outputs

    return run


def alltoall_single(
    size: int,
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
    timeout: float,
) -> tuple[str, Run]:
    """all_to_all_single: without split sizes one dsml all_to_all of equal parts;
    with them, `alltoall` of the parts they cut. Returns the call's name for its errors
    with its `Run`."""
    if not output_split_sizes and not input_split_sizes:
        return "all_to_all_single", _alltoall_even(size, output, input, timeout)
    try:
        ins = list(torch.split(input, list(input_split_sizes) or input.shape[0] // size))
        outs = list(torch.split(output, list(output_split_sizes) or output.shape[0] // size))
    except RuntimeError as exc:  # split sizes that do not add up to the tensor
        error = ValueError(f"all_to_all_single: {exc}")

        async def refused(comm: Communicator) -> Tensors:
            await _refuse(comm, 1, error)
            return []

        return "all_to_all_single", refused
    return "alltoall", alltoall(size, outs, ins, timeout)


def _alltoall_even(size: int, output: torch.Tensor, input: torch.Tensor, timeout: float) -> Run:
    wrong = ""
    if input.shape[0] % size:
        wrong = (
            f"all_to_all_single: dim 0 ({input.shape[0]}) must divide by the world "
            f"size ({size}) when no split sizes are given"
        )

    async def run(comm: Communicator) -> Tensors:
        if wrong:
            await _refuse(comm, 1, ValueError(wrong))
        _copy_into(output, await comm.all_to_all(_flat(input), timeout=timeout))
        return [output]

    return run
