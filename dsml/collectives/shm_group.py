"""What the shared-memory algorithms see of a host's group (collectives layer).

A `ShmGroup` is one call's view of the same-host link: the local rank and size, this
rank's and every peer's *data area* (one shared segment per rank, read directly), two
small *inline* areas per rank for small calls (they alternate by call, so a call with a
single sync may write its input before that sync), and `sync`, a barrier by shared
counters. The first `sync` of a call compares every rank's fingerprint (a mismatch raises
`CollectiveMismatchError`) and tells whether every rank found room for its data; when one
did not, the algorithm returns False and the caller runs a TCP algorithm instead.

Ordering rules every algorithm keeps, so calls never overwrite what a slower peer still
reads: a rank writes its data area's first half (staging) only before a sync and after
the previous call's last sync; it writes the second half (results) only after its
call's first sync; inline areas are written before the first sync only.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["ShmGroup", "halves"]


class ShmGroup(Protocol):
    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def inline_bytes(self) -> int: ...

    def reserve(self, nbytes: int) -> bool:
        """Make this rank's data area at least nbytes; False when there is no room."""
        ...

    def area(self, rank: int) -> Any:
        """A rank's data area (uint8 numpy array); this rank's own is writable."""
        ...

    def inline(self, rank: int) -> Any:
        """A rank's inline area for this call (uint8 numpy array of inline_bytes)."""
        ...

    async def sync(self, ok: bool = True) -> bool:
        """Post this rank's next phase and wait for every peer's; see the module doc."""
        ...


def halves(area: Any) -> tuple[Any, Any]:
    """(staging, results): the two halves of a data area."""
    half = len(area) // 2
    return area[:half], area[half : 2 * half]
