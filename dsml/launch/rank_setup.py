"""What each rank the launcher starts gets: its environment and its CPUs (launch layer).

CPU binding (`cpu_bind`): with more ranks than the CPUs the launcher may use ("auto", the
default), rank i is bound to one CPU, i modulo their number, so the ranks spread evenly.
Left to the scheduler, ranks that mostly wait (for a peer, in shared memory or on a
socket) look idle to it and stay where they started: 4 ranks on 2 CPUs were seen split 3
and 1 for a whole run, each call then taking up to 2x longer. With fewer ranks than CPUs
nothing is bound under "auto" (a rank's compute threads may use every CPU); "spread" then
gives each rank its own block of CPUs, "none" never binds.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping

from .._process import die_with_parent

__all__ = ["CPU_BIND", "child_setup", "cpu_sets", "rank_environment"]

CPU_BIND = ("auto", "spread", "none")  # see the module docstring


def rank_environment(
    base: Mapping[str, str],
    rank: int,
    world_size: int,
    registry: str,
    device: str | None = None,
    *,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    node_rank: int = 0,
) -> dict[str, str]:
    """The environment of one rank: DSML_* for dsml.init, and what torchrun users expect.

    With `device` ("cpu", "cuda" or "cuda:N") every rank gets DSML_DEVICE; with "cuda",
    `dsml.init()` then picks GPU LOCAL_RANK % gpu count, so local rank i gets GPU i.
    """
    env = dict(base)
    if device is not None:
        env["DSML_DEVICE"] = device
    local_rank = rank if local_rank is None else local_rank
    local_world_size = world_size if local_world_size is None else local_world_size
    env.update(
        DSML_REGISTRY=registry,
        DSML_WORLD_SIZE=str(world_size),
        DSML_RANK=str(rank),
        DSML_LOCAL_RANK=str(local_rank),
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(local_world_size),
        GROUP_RANK=str(node_rank),
        PYTHONUNBUFFERED="1",
    )
    if not env.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = "1"  # ranks share the cores; a user's own value stays
    return env


def cpu_sets(ranks: int, bind: str = "auto") -> list[set[int]] | None:
    """The CPUs of each of `ranks` local ranks under `bind` (see the module docstring),
    from those this process may use; None: leave them unbound."""
    if bind not in CPU_BIND:
        raise ValueError(f"cpu_bind must be one of {', '.join(CPU_BIND)}, got {bind!r}")
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: no binding
        return None
    if bind == "none" or ranks < 1 or (bind == "auto" and ranks <= len(cpus)):
        return None
    if ranks >= len(cpus):
        return [{cpus[i % len(cpus)]} for i in range(ranks)]
    block = len(cpus) // ranks
    return [set(cpus[i * block : (i + 1) * block]) for i in range(ranks)]


def child_setup(cpus: set[int] | None) -> Callable[[], None] | None:
    """The `preexec_fn` of a rank: die with the launcher, and run on `cpus` if given."""
    if cpus is None:
        return die_with_parent

    def setup() -> None:  # pragma: no cover - runs in the child before exec
        if die_with_parent is not None:
            die_with_parent()
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpus)

    return setup
