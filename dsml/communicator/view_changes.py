"""Changes of membership as one rank sees them (communicator layer).

The registry's news arrives here (`Listener`), and every collective that cannot start at
once passes `admit()` first. The rules, the same on every rank:

- **Loss** (a member died, or was evicted): every call of the epoch in flight fails with
  `PeerLostError`. If none was in flight, the next call fails instead, so that every
  survivor's program sees the loss exactly once. The call after that waits for the
  registry's new view, then runs in it as collective #1.
- **Leave** (a member closed its communicator after collective #last): calls up to #last
  run normally; the first one after fails as before (the member closed), and the next one
  runs in the new view.
- **Join** (agreed with the registry): the registry asks where each member is; the rank
  answers with its next collective id and holds the calls from there on. The registry
  takes the largest answer as the boundary: calls below it run in the old epoch, the one
  at the boundary waits for them to finish, then runs first in the new view. Nothing of
  the old epoch is disturbed.
- **Eviction**: this rank was declared dead (it was silent too long). Every call fails
  with `EvictedError`; the application may join again as a new member.

A dropped connection to a peer (seen by the transport's socket monitor) counts as a loss
here at once and is reported to the registry, which checks it and publishes the new view.

The states a rank can be in and the events that move it are named in `ViewState` and
`TRANSITIONS` (view_states.py; a diagram is in docs/architecture.md). Every event handler
records the transition it made in `history`; a transition the table does not list is a
bug and is logged as an error (tests/unit/test_view_changes.py drives each one).

The rules are carried out in three parts, one class each: `ViewBase` (view_base.py: what
the rank knows, the named state, the errors calls fail with), `ViewEvents`
(view_events.py: the events) and `ViewAdmission` (view_admission.py: when calls start,
installing views). `ViewChanges` puts them together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ..membership import RegistryClient, View
from .call_table import CallTable
from .links import PeerLinks
from .view_admission import ViewAdmission
from .view_base import ViewListener
from .view_events import ViewEvents
from .view_states import TRANSITIONS, ViewState

if TYPE_CHECKING:
    from .survival import Survival

__all__ = ["TRANSITIONS", "ViewChanges", "ViewListener", "ViewState", "Views"]


class Views(Protocol):
    """What a communicator's calls ask about views: `ViewChanges` on the root, `SubViews`
    (subgroups.py) on a sub-group, whose view is fixed."""

    listeners: list[ViewListener]
    installed: int
    interrupt_on_join: bool

    @property
    def evicted(self) -> bool:
        """Whether the registry declared this rank dead (a sub-group: never)."""
        ...

    def immediate(self) -> bool:
        """Whether a call may start now, without waiting its turn (`admit`)."""
        ...

    async def admit(self) -> None:
        """Wait until a call may start in the current view (or raise why it cannot)."""
        ...

    def ensure_current(self) -> None:
        """Raise the error a call started now fails with, if any."""
        ...

    def next_view(self) -> View:
        """The view the next call runs in."""
        ...

    async def wait_known(self, timeout: float | None = None) -> View:  # noqa: ASYNC109
        """Wait for a view newer than the current one."""
        ...


class ViewChanges(ViewEvents, ViewAdmission):
    """Applies the registry's views to one rank; see the module docstring."""

    def __init__(
        self, table: CallTable, links: PeerLinks, registry: RegistryClient, view_timeout: float
    ) -> None:
        super().__init__(table, links, registry, view_timeout)
        table.report_departures(self.peer_left)

    def use_survival(self, survival: Survival) -> None:
        """Decide losses with `survival` while the registry is away (the root's)."""
        self.survival = survival
