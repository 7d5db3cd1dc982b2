"""Joins agreed with the registry, as one rank holds them (communicator layer).

A join goes in two steps (docs/faults.md): the registry proposes it, and this rank
answers with its next collective id and holds its calls from there on (`gate`); the
registry then sends the view with the boundary it took, and the call at that boundary
installs it (`agreed`). `Joins` is owned by `ViewChanges` (view_changes.py), which calls
its methods; its fields are written here only.
"""

from __future__ import annotations

from ..membership import View

__all__ = ["Joins"]


class Joins:
    """The gate a proposal set and the agreed joins waiting for their boundary."""

    __slots__ = ("agreed", "gate")

    def __init__(self) -> None:
        self.agreed: list[tuple[int, View]] = []  # (boundary, view), oldest first
        self.gate: tuple[int, int] | None = None  # (epoch, cid) from which calls wait

    def propose(self, epoch: int, next_cid: int) -> None:
        """Hold calls from collective `next_cid` of `epoch` on (a join is proposed)."""
        self.gate = (epoch, next_cid)

    def drop_proposal(self) -> None:
        """The proposal is over: its view came, or the registry that made it restarted."""
        self.gate = None

    def agree(self, boundary: int, view: View) -> None:
        """The registry's view with a boundary: the call there installs `view`."""
        self.agreed.append((boundary, view))

    def cancel(self) -> None:
        """A loss or a renewed epoch: the agreed joins will not be entered."""
        self.agreed.clear()

    def installed(self, view: View) -> None:
        """`view` is installed: the agreed join it completes is over."""
        if self.agreed and self.agreed[0][1] is view:
            self.agreed.pop(0)

    def due(self, cid: int) -> View | None:
        """The view a call numbered `cid` must install first (None: none)."""
        if self.agreed and cid >= self.agreed[0][0]:
            return self.agreed[0][1]
        return None

    def holds(self, epoch: int, cid: int) -> bool:
        """Whether a call numbered `cid` in `epoch` waits for the proposal's outcome."""
        return self.gate is not None and (epoch, cid) >= self.gate

    def renumber(self, epoch: int, next_cid: int) -> tuple[int, int]:
        """(epoch, next collective id) counted in the numbering of the last agreed view."""
        for boundary, view in self.agreed:
            epoch, next_cid = view.epoch, max(next_cid, boundary) - boundary + 1
        return epoch, next_cid

    def __repr__(self) -> str:
        agreed = [(b, v.epoch) for b, v in self.agreed]
        return f"<Joins gate={self.gate} agreed={agreed}>"
