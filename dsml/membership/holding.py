"""What a member holds of messages for a view it has not installed yet (membership layer).

A peer that moved to the next epoch first may send for it before this member got the new
view; those messages are held and replayed once the view is in. Anyone who can connect
could also send "future" messages to fill memory, so holding is bounded:

- only from members of the current view or of a view already announced (`allow`): the
  others' messages are dropped and counted (`dropped_foreign`);
- within a fixed budget of frames and bytes per sender and in total (`HoldBudget`):
  beyond it, messages are dropped and counted (`dropped_over_budget`). A legitimate peer
  sends at most a few collectives' worth before it must wait for this member, so the
  budget is set well above that (the default 64 MiB total, 16 MiB per sender).

`FutureHold` keeps the held items and releases them in arrival order. It is pure logic
(no sockets, no clock): the communicator calls it from its reader.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["FutureHold", "HoldBudget"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class HoldBudget:
    """Caps on held messages, per sender and in total."""

    max_frames: int = 4096
    max_bytes: int = 64 << 20
    max_frames_per_sender: int = 1024
    max_bytes_per_sender: int = 16 << 20

    def __post_init__(self) -> None:
        for name in ("max_frames", "max_bytes", "max_frames_per_sender", "max_bytes_per_sender"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 0:
                raise ValueError(f"HoldBudget.{name} must be a non-negative integer")


@dataclass(slots=True)
class _Account:
    frames: int = 0
    bytes: int = 0


@dataclass(slots=True)
class FutureHold(Generic[T]):
    """Messages held for a view not installed yet; see the module docstring."""

    budget: HoldBudget = field(default_factory=HoldBudget)
    allowed: set[str] = field(default_factory=set)
    counters: Counter[str] = field(default_factory=Counter)
    _items: list[tuple[str, int, T]] = field(default_factory=list)
    _per_sender: dict[str, _Account] = field(default_factory=dict)
    _total: _Account = field(default_factory=_Account)

    def allow(self, members: Iterable[str]) -> None:
        """Accept future messages from these members too (the current or announced view)."""
        self.allowed.update(members)

    def reset_allowed(self, members: Iterable[str]) -> None:
        """Accept future messages only from these members from now on."""
        self.allowed = set(members)

    def hold(self, sender: str, nbytes: int, item: T) -> str:
        """Keep `item` from `sender` if allowed and within budget.

        Returns "held", "foreign" (not a member: dropped) or "over_budget" (dropped).
        """
        if sender not in self.allowed:
            self.counters["dropped_foreign"] += 1
            return "foreign"
        account = self._per_sender.setdefault(sender, _Account())
        budget = self.budget
        if (
            account.frames + 1 > budget.max_frames_per_sender
            or account.bytes + nbytes > budget.max_bytes_per_sender
            or self._total.frames + 1 > budget.max_frames
            or self._total.bytes + nbytes > budget.max_bytes
        ):
            self.counters["dropped_over_budget"] += 1
            return "over_budget"
        account.frames += 1
        account.bytes += nbytes
        self._total.frames += 1
        self._total.bytes += nbytes
        self._items.append((sender, nbytes, item))
        self.counters["held"] += 1
        return "held"

    def release(self) -> list[T]:
        """Everything held, in arrival order; the hold is empty afterwards."""
        items = [item for _sender, _nbytes, item in self._items]
        self._items.clear()
        self._per_sender.clear()
        self._total = _Account()
        return items

    def drop_from(self, senders: Iterable[str]) -> int:
        """Forget what these senders' messages held (they left the group); returns how many."""
        gone = set(senders)
        kept = [entry for entry in self._items if entry[0] not in gone]
        dropped = len(self._items) - len(kept)
        self._items = kept
        for sender in gone:
            account = self._per_sender.pop(sender, None)
            if account is not None:
                self._total.frames -= account.frames
                self._total.bytes -= account.bytes
        self.counters["dropped_foreign"] += dropped
        return dropped

    @property
    def frames(self) -> int:
        return self._total.frames

    @property
    def nbytes(self) -> int:
        return self._total.bytes

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return (
            f"FutureHold(frames={self.frames}, bytes={self.nbytes}, "
            f"allowed={len(self.allowed)}, {dict(self.counters)})"
        )
