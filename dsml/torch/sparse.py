"""all_reduce of sparse COO tensors, as gloo does it (adapter layer).

Cost: three all_gathers (every rank's number of non-zeros and layout; the indices; the
values, each padded to the largest count), then a local sum: each rank receives every
rank's non-zeros, (world - 1) x nnz x (sparse_dim x 8 + value bytes) in all. The result
is the sum of every rank's tensor, coalesced (duplicate indices added), written into the
input tensor, which stays sparse. Only SUM, as with gloo.
"""

from __future__ import annotations

from typing import Any

import torch

from ..collectives.interop import like
from ..communicator import Communicator
from .mapping import _all, _code, _first_other, _table

__all__ = ["all_reduce_sparse"]


async def all_reduce_sparse(
    comm: Communicator,
    t: torch.Tensor,
    op: str,
    timeout: float,  # noqa: ASYNC109 (each call takes it)
) -> None:
    """t = the sum over ranks of t (a sparse COO tensor), coalesced, in place."""
    indices, values = t._indices(), t._values()
    sparse_dim, nnz = indices.shape
    layout = _code((tuple(t.shape), str(t.dtype), sparse_dim, op))
    table = await _table(comm, [nnz, layout], timeout)
    other = _first_other(table[:, 1:], 0)
    if op != "sum":
        raise ValueError(f"sparse all_reduce: only ReduceOp.SUM is supported, not {op}")
    if other is not None:
        raise ValueError(
            f"sparse all_reduce: rank {other}'s tensor differs from rank 0's in shape, "
            "dtype or number of sparse dimensions"
        )
    counts = [int(n) for n in table[:, 0]]
    longest = max(max(counts), 1)
    padded_indices = indices.new_zeros((sparse_dim, longest))
    padded_indices[:, :nnz] = indices
    padded_values = values.new_zeros((longest, *values.shape[1:]))
    padded_values[:nnz] = values
    got = await _all(
        [
            comm.all_gather(padded_indices.reshape(-1), timeout=timeout),
            comm.all_gather(padded_values.reshape(-1), timeout=timeout),
        ]
    )
    every_indices = _tensor(got[0], padded_indices).reshape(len(counts), sparse_dim, longest)
    every_values = _tensor(got[1], padded_values).reshape(len(counts), longest, *values.shape[1:])
    total = torch.sparse_coo_tensor(
        torch.cat([every_indices[r, :, :n] for r, n in enumerate(counts)], dim=1),
        torch.cat([every_values[r, :n] for r, n in enumerate(counts)], dim=0),
        t.shape,
    ).coalesce()
    t.copy_(total)


def _tensor(value: Any, like_this: torch.Tensor) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else like(value, like_this)
