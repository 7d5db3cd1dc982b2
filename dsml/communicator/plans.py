"""Validating a collective call and planning its execution (communicator layer).

Each public method checks the caller's arguments on this rank (raising `ConfigError`
before anything is sent), builds the call's fingerprint, and returns the coroutine that
runs it once a `Call` exists. Results are written into the caller's array only after the
algorithm has succeeded, so a failed call leaves every input intact. Plans are made for
numpy arrays; `Placement` (placement.py) adapts them to cupy arrays.

The planner is made of parts, one module each: `PlannerBase` (plan_base.py: `Request`,
`Plan`, the work-buffer pools and the argument checks every plan shares),
`ReductionPlans` (plan_reductions.py: all_reduce, reduce, reduce_scatter, and
`choose_algorithm`) and `MovementPlans` (plan_movement.py: broadcast, all_gather,
gather, scatter, all_to_all, barrier). This module dispatches a request to its plan.
"""

from __future__ import annotations

from ..errors import ConfigError
from .plan_base import ROOTED, SHM_ALGORITHMS, Plan, Request, loose_fingerprint
from .plan_movement import MovementPlans
from .plan_reductions import ReductionPlans

__all__ = ["ROOTED", "SHM_ALGORITHMS", "Plan", "Planner", "Request", "loose_fingerprint"]


class Planner(ReductionPlans, MovementPlans):
    """Plans calls for one communicator; owns its work-buffer pools."""

    # -- one entry point ---------------------------------------------------------------------

    def plan(self, request: Request, rank: int, size: int) -> Plan:
        """Check a call's arguments on this rank and plan it for a group of `size`.

        Raises `ConfigError` before anything is sent. Plans are made for numpy arrays;
        `Placement.place` adapts them to device arrays.
        """
        name = request.collective
        if name == "barrier":
            return self._barrier()
        root = self._root(request.root, size) if name in ROOTED else 0
        if name == "scatter" and rank != root:
            return self._receive_scatter(root)  # non-roots have no input
        x = request.x
        if name == "scatter" and x is None:
            raise ConfigError(f"scatter: the root (rank {root}) must pass the array to scatter")
        x, on_device = self._placement.place(x, request.caller)
        plan: Plan = getattr(self, f"_{name}")(x, request, rank, size, root)
        if on_device is None:
            return plan
        is_root = rank == root
        return on_device.adapt(
            plan,
            needs_input=not (name == "broadcast" and not is_root),  # the others receive all
            writes_back=not (name == "broadcast" and is_root),  # the root's x is unchanged
        )
