"""What the shared-memory algorithms see of a host's group (collectives layer).

A `ShmGroup` is one call's view of the same-host link: the local rank and size, this
rank's and every peer's *data area* (one shared segment per rank, read directly), two
small *inline* areas per rank for small calls (they alternate by call, so a call with a
single sync may write its input before that sync), and `sync`, a barrier by shared
counters. The first `sync` of a call compares every rank's fingerprint (a mismatch raises
`CollectiveMismatchError`) and tells whether every rank found room for its data; when one
did not, the algorithm returns False and the caller runs a TCP algorithm instead.

A data area holds *results* at its start and *staging* at its end (`results`,
`staging`); `reserve` keeps the two apart, also from the previous call's results. Ordering
rules every algorithm keeps, so calls never overwrite what a slower peer still reads: a
rank writes its staging only before a sync, and results only after its call's first
sync; inline areas are written before the first sync only; peers read staging only
before the call's last sync.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["ShmGroup", "results", "staging"]


class ShmGroup(Protocol):
    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def inline_bytes(self) -> int: ...

    def reserve(self, results_bytes: int, staging_bytes: int) -> bool:
        """Make room for this call's results and staging; False when there is none."""
        ...

    def area(self, rank: int) -> Any:
        """A rank's data area (uint8 numpy array); this rank's own is writable."""
        ...

    def inline(self, rank: int) -> Any:
        """A rank's inline area for this call (uint8 numpy array of inline_bytes)."""
        ...

    def inlines(self) -> list[Any]:
        """Every rank's inline area for this call, in rank order (after the first sync)."""
        ...

    async def sync(self, ok: bool = True) -> bool:
        """Post this rank's next phase and wait for every peer's; see the module doc."""
        ...


def staging(area: Any, nbytes: int) -> Any:
    """The staging part of a data area: its last nbytes (uint8)."""
    return area[len(area) - nbytes :]


def results(area: Any) -> Any:
    """The results part of a data area: from its start (uint8)."""
    return area
