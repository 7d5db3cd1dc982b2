"""Choosing an all-reduce algorithm by message size (collectives layer).

`auto` must pick the same algorithm on every rank, so the choice depends only on the
array's size in bytes and the group size, through a fixed table measured with `dsml bench`
on loopback (2 cores, 2-4 ranks; see docs/operations.md for the figures): recursive
doubling wins while latency dominates, the ring once bandwidth does.
"""

from __future__ import annotations

from ..errors import ConfigError

__all__ = ["ALL_REDUCE_ALGORITHMS", "check_algorithm", "choose_all_reduce"]

ALL_REDUCE_ALGORITHMS = ("ring", "tree", "naive", "direct", "mesh")

#: Largest array (bytes) for which recursive doubling beats the ring.
TREE_MAX_BYTES = 256 * 1024


def check_algorithm(name: object) -> str:
    """Validate an `algorithm=` argument ("auto" included)."""
    if name == "auto" or name in ALL_REDUCE_ALGORITHMS:
        return str(name)
    choices = ", ".join(repr(a) for a in ("auto", *ALL_REDUCE_ALGORITHMS))
    raise ConfigError(f"unknown all_reduce algorithm {name!r}; use one of {choices}")


def choose_all_reduce(nbytes: int, world_size: int) -> str:
    """The algorithm `auto` stands for at this size (identical on every rank)."""
    if nbytes <= TREE_MAX_BYTES:
        return "tree"
    return "ring"
