"""Choosing an all-reduce algorithm by message size (collectives layer).

`auto` must pick the same algorithm on every rank, so the choice depends only on the
array's size in bytes and the group size, through a fixed table measured with
`benchmarks/tune_auto.py` (loopback, 2 cores, 2-4 ranks; figures in docs/operations.md).

On loopback a message costs far more than its bytes: each one wakes ZeroMQ's I/O threads
on both sides. So the fewest messages win for small and medium arrays: recursive doubling
(`tree`) up to 16 KiB, everyone-to-rank-0-and-back (`naive`, 2(P-1) messages) up to 1 MiB.
Above that the work must be shared: the ring with 2 ranks, the two-hop full mesh with 3-4.
For more ranks than measured, the table falls back to what scales: `tree` for small
arrays, the `ring` for large ones.
"""

from __future__ import annotations

from ..errors import ConfigError

__all__ = ["ALL_REDUCE_ALGORITHMS", "check_algorithm", "choose_all_reduce"]

ALL_REDUCE_ALGORITHMS = ("ring", "tree", "naive", "direct", "mesh", "shm", "hierarchical")

SMALL_BYTES = 16 * 1024  # up to here: recursive doubling
MEDIUM_BYTES = 1 << 20  # up to here: naive, when P is small enough for rank 0 to keep up
MEASURED_RANKS = 4  # the table was measured up to this many ranks


def check_algorithm(name: object) -> str:
    """Validate an `algorithm=` argument ("auto" included)."""
    if type(name) is str and (name == "auto" or name in ALL_REDUCE_ALGORITHMS):
        return name
    choices = ", ".join(repr(a) for a in ("auto", *ALL_REDUCE_ALGORITHMS))
    raise ConfigError(f"unknown all_reduce algorithm {name!r}; use one of {choices}")


def choose_all_reduce(nbytes: int, world_size: int) -> str:
    """The algorithm `auto` stands for at this size (identical on every rank)."""
    if nbytes <= SMALL_BYTES or world_size <= 1:
        return "tree"
    if world_size > MEASURED_RANKS:
        return "tree" if nbytes <= MEDIUM_BYTES else "ring"
    if nbytes <= MEDIUM_BYTES:
        return "naive"
    return "ring" if world_size == 2 else "mesh"
