"""Validating a collective call and planning its execution (communicator layer).

Each collective has one plan: a plain function of the communicator's `PlanState` that
checks the caller's arguments on this rank (raising `ConfigError` before anything is
sent), builds the call's fingerprint, and returns the coroutine that runs it once a
`Call` exists. Results are written into the caller's array only after the algorithm has
succeeded, so a failed call leaves every input intact. Plans are made for numpy arrays;
`Placement` (placement.py) adapts them to cupy arrays.

The plans: plan_reductions.py (all_reduce, reduce, reduce_scatter, and
`choose_all_reduce`, the one place that decides what an all_reduce runs) and
plan_movement.py (broadcast, all_gather, gather, scatter, all_to_all, barrier); what
they share is in plan_base.py (`Request`, `Plan`) and plan_state.py (`PlanState`). This
module dispatches a request to its plan through `PLANS`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import ConfigError
from .plan_base import (
    ROOTED,
    SHM_ALGORITHMS,
    Plan,
    Request,
    check_root,
    loose_fingerprint,
)
from .plan_movement import (
    plan_all_gather,
    plan_all_to_all,
    plan_barrier,
    plan_broadcast,
    plan_gather,
    plan_receive_scatter,
    plan_scatter,
)
from .plan_reductions import plan_all_reduce, plan_reduce, plan_reduce_scatter
from .plan_state import PlanState

__all__ = [
    "PLANS",
    "ROOTED",
    "SHM_ALGORITHMS",
    "Plan",
    "PlanState",
    "Request",
    "loose_fingerprint",
    "plan",
]

#: the plan of each collective with an input: (state, x, request, rank, size, root) -> Plan
PLANS: dict[str, Callable[[PlanState, Any, Request, int, int, int], Plan]] = {
    "all_reduce": plan_all_reduce,
    "reduce": plan_reduce,
    "reduce_scatter": plan_reduce_scatter,
    "broadcast": plan_broadcast,
    "all_gather": plan_all_gather,
    "gather": plan_gather,
    "scatter": plan_scatter,
    "all_to_all": plan_all_to_all,
}


def plan(state: PlanState, request: Request, rank: int, size: int) -> Plan:
    """Check a call's arguments on this rank and plan it for a group of `size`.

    Raises `ConfigError` before anything is sent. Plans are made for numpy arrays;
    `Placement.place` adapts them to device arrays.
    """
    name = request.collective
    if name == "barrier":
        return plan_barrier(state)
    root = check_root(request.root, size) if name in ROOTED else 0
    if name == "scatter" and rank != root:
        return plan_receive_scatter(state, root)  # non-roots have no input
    x = request.x
    if name == "scatter" and x is None:
        raise ConfigError(f"scatter: the root (rank {root}) must pass the array to scatter")
    x, on_device = state.placement.place(x, request.caller)
    made = PLANS[name](state, x, request, rank, size, root)
    if on_device is None:
        return made
    is_root = rank == root
    return on_device.adapt(
        made,
        needs_input=not (name == "broadcast" and not is_root),  # the others receive all
        writes_back=not (name == "broadcast" and is_root),  # the root's x is unchanged
    )
