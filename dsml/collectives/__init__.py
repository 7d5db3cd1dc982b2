"""Collectives layer: reduce ops, dtypes, chunking, and one module per algorithm.

Every algorithm is written against the small `Group` interface (rank, size, send/recv to a
peer) and the `ArrayBackend` (bytes to send, reduce or write what arrives); it knows
nothing about sockets, epochs or registries.
"""

from .all_gather import all_gather_direct
from .all_reduce_direct import all_reduce_direct
from .all_reduce_mesh import all_reduce_mesh
from .all_reduce_naive import all_reduce_naive
from .all_reduce_ring import all_reduce_ring
from .all_reduce_tree import all_reduce_tree
from .all_to_all import all_to_all_direct
from .arrays import NUMPY, ArrayBackend, BufferPool, backend_of
from .barrier import barrier_dissemination
from .broadcast import broadcast_tree
from .gather import gather_direct
from .group import Group, Lane, Receipt, Received
from .ops import DTYPES, ReduceOp, check_op, dtype_name
from .reduce import reduce_tree
from .reduce_scatter import reduce_scatter_ring
from .scatter import scatter_direct
from .select import ALL_REDUCE_ALGORITHMS, check_algorithm, choose_all_reduce

ALL_REDUCE = {
    "ring": all_reduce_ring,
    "tree": all_reduce_tree,
    "naive": all_reduce_naive,
    "direct": all_reduce_direct,
    "mesh": all_reduce_mesh,
}

__all__ = [
    "ALL_REDUCE",
    "ALL_REDUCE_ALGORITHMS",
    "DTYPES",
    "NUMPY",
    "ArrayBackend",
    "BufferPool",
    "Group",
    "Lane",
    "Receipt",
    "Received",
    "ReduceOp",
    "all_gather_direct",
    "all_reduce_direct",
    "all_reduce_mesh",
    "all_reduce_naive",
    "all_reduce_ring",
    "all_reduce_tree",
    "all_to_all_direct",
    "backend_of",
    "barrier_dissemination",
    "broadcast_tree",
    "check_algorithm",
    "check_op",
    "choose_all_reduce",
    "dtype_name",
    "gather_direct",
    "reduce_scatter_ring",
    "reduce_tree",
    "scatter_direct",
]
