"""Survivors agreeing on a new view without the registry (membership layer, pure logic).

When members are lost while the registry is away, the survivors still need one new view,
the same on every one of them. The rule is deterministic, so agreeing is only agreeing on
*who was lost*:

- **The successor view** of view V without the lost set L: the members of V not in L, in
  V's ring order; epoch V.epoch + 1. Ranks are positions in that order, so every survivor
  computes the same ranks and ring from the same L (`successor`). Its `digest` (a hash of
  the epoch and the member ids in order) names it in messages and logs.
- **Quorum**: only a strict majority of V may form a view without the registry
  (`has_quorum`). Two disjoint sets cannot both be majorities of V, so an asymmetric
  partition never leaves two groups running. A minority waits for the registry (its calls
  fail with `NoQuorumError`) and is told by the registry, once back, whether it was
  dropped.
- **Agreement** (`Agreement`): each survivor proposes the set of members it lost (its data
  links to them dropped or went silent). A proposal received from a member of the
  candidate view widens the lost set to the union (suspicions only grow, so this ends).
  A survivor whose own lost set grew proposes again. The view is decided when every member
  of the candidate view has proposed exactly the current lost set (everyone is known to
  agree) and a proposal has also come from every member counted lost on someone else's
  word that this survivor can still reach: it may know of more cuts. Proposals for another
  previous epoch are ignored.

A new failure during the round (a member that had proposed the same set widens it after a
peer already decided) can still make two survivors decide different successors; they then
fail each other's calls (the member sets differ) and the registry, once back, settles it
with one more epoch. Members only wait in a round while their failure detector has not
named the silent peers, so a round ends as soon as the detection does.

The union rule means that when two members of a view suspect each other (the link between
them is cut, both still reach the rest), both are dropped: a group that loses its quorum
that way waits for the registry rather than guessing which one to keep.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..errors import NoQuorumError
from .view import View

__all__ = ["Agreement", "digest", "has_quorum", "successor"]


def successor(view: View, lost: Iterable[str]) -> View:
    """The view after `view` without the members `lost`: ring order kept, epoch + 1."""
    gone = set(lost)
    members = tuple(m for m in view.members if m.id not in gone)
    if not members:
        raise ValueError("a successor view needs at least one member")
    return View(view.epoch + 1, members)


def digest(view: View) -> str:
    """A short name of a view, equal on every member that computed the same view."""
    text = "\n".join([str(view.epoch), *(m.id for m in view.members)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def has_quorum(previous: View, survivors: Iterable[str]) -> bool:
    """Whether `survivors` are a strict majority of `previous` (members not in it ignored)."""
    ids = {m.id for m in previous.members}
    alive = len(ids & set(survivors))
    return 2 * alive > previous.size


@dataclass(slots=True)
class Agreement:
    """One member's side of agreeing on the successor of `previous`; see the module
    docstring. Feed it suspicions and the peers' proposals; read `decided`."""

    previous: View
    me: str
    lost: set[str] = field(default_factory=set)
    direct: set[str] = field(default_factory=set)  # lost by this member's own detection
    heard: set[str] = field(default_factory=set)  # members whose proposal arrived
    proposals: dict[str, frozenset[str]] = field(default_factory=dict)  # member -> its lost
    sent: frozenset[str] | None = None  # the lost set this member last proposed

    def __post_init__(self) -> None:
        assert self.previous.rank_of(self.me) is not None, "a member of the previous view"

    # -- inputs -------------------------------------------------------------------------------

    def suspect(self, members: Iterable[str]) -> bool:
        """This member lost these peers. Returns whether the lost set grew (propose again)."""
        members = list(members)
        self.direct.update(m for m in members if self.previous.rank_of(m) is not None)
        self.direct.discard(self.me)
        return self._widen(members)

    def receive(self, sender: str, epoch: int, lost: Iterable[str]) -> bool:
        """A peer's proposal for the successor of epoch `epoch`. Returns whether this
        member's lost set grew (it must propose again)."""
        if epoch != self.previous.epoch or self.previous.rank_of(sender) is None:
            return False
        if sender == self.me:
            return False
        self.heard.add(sender)
        if sender in self.direct:
            return False  # this member lost it: what it says cannot change our group
        theirs = frozenset(m for m in lost if self.previous.rank_of(m) is not None)
        self.proposals[sender] = theirs
        if self.me in theirs:
            return False  # that side drops this member: it will not agree with us
        return self._widen(theirs)

    def _widen(self, members: Iterable[str]) -> bool:
        new = {m for m in members if self.previous.rank_of(m) is not None and m != self.me}
        grew = not new <= self.lost
        self.lost |= new
        return grew

    # -- outputs ------------------------------------------------------------------------------

    def proposal(self) -> frozenset[str]:
        """The lost set to send to the peers now (remembered as sent)."""
        self.sent = frozenset(self.lost)
        return self.sent

    @property
    def candidate(self) -> View:
        return successor(self.previous, self.lost)

    @property
    def quorate(self) -> bool:
        return has_quorum(self.previous, (m.id for m in self.candidate.members))

    def check_quorum(self) -> None:
        """Raise `NoQuorumError` when the survivors are no majority of the previous view."""
        if not self.quorate:
            survivors = self.previous.size - len(self.lost)
            raise NoQuorumError(
                f"only {survivors} of the {self.previous.size} members of epoch "
                f"{self.previous.epoch} are reachable from here, not a majority: this side "
                "may not form a view on its own. Calls fail until the registry says which "
                "group goes on (this side may be the one that stalled or was cut off: join "
                "again if it was dropped)",
                epoch=self.previous.epoch,
            )

    @property
    def decided(self) -> View | None:
        """The agreed view once every member of the candidate proposed the same lost set
        (this member included), every reachable lost member was heard, and the candidate
        has quorum; else None."""
        if not self.lost or self.sent != frozenset(self.lost) or not self.quorate:
            return None
        if self.waiting_for():
            return None
        return self.candidate

    def waiting_for(self) -> list[str]:
        """Members whose (matching) proposal has not arrived: those of the candidate view,
        and the members lost on someone else's word that this member did not hear."""
        now = frozenset(self.lost)
        waiting = [
            m.id
            for m in self.candidate.members
            if m.id != self.me and self.proposals.get(m.id) != now
        ]
        hearsay = self.lost - self.direct - self.heard
        return waiting + [m.id for m in self.previous.members if m.id in hearsay]

    def __repr__(self) -> str:
        return (
            f"Agreement(previous={self.previous.epoch}, lost={sorted(self.lost)}, "
            f"agreed_by={len(self.proposals)}, quorate={self.quorate})"
        )
