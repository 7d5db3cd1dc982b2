"""The states of one rank's view of membership, and the events that move it (communicator).

`ViewChanges` (view_changes.py) applies the events; this table is the whole machine at a
glance, and `transition` checks every state change it makes against it. `Views` is what
a communicator's calls ask of it (or of a sub-group's fixed `SubViews`). A diagram is in
docs/architecture.md; tests/unit/test_view_changes.py drives each transition.
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from ..membership import View

__all__ = ["TRANSITIONS", "ViewListener", "ViewState", "Views", "transition"]

log = logging.getLogger("dsml.communicator")

F = TypeVar("F", bound=Callable[..., Any])

ViewListener = Callable[["View", "View"], Any]


class ViewState(enum.Enum):
    """Where one rank stands with respect to changes of the group."""

    JOINING = "joining"  # no view installed yet
    STEADY = "steady"  # calls run at once in the installed view
    JOIN_PROPOSED = "join proposed"  # the registry asked where we are; calls from there wait
    JOIN_AGREED = "join agreed"  # a boundary is agreed: the call there installs the new view
    MEMBER_LEFT = "member left"  # calls up to the leaver's last run; the next fails once
    MEMBER_LOST = "member lost"  # calls in flight failed; the next waits for the new view
    NO_QUORUM = "no quorum"  # lost members without the registry, no majority: calls fail
    EVICTED = "evicted"  # this rank was declared dead: every call fails (final)


S = ViewState
_ANY = frozenset(ViewState) - {S.JOINING, S.EVICTED}
_BROKEN = frozenset({S.MEMBER_LEFT, S.MEMBER_LOST, S.NO_QUORUM})

#: event -> state before -> the states it may lead to. Everything not listed is a bug.
TRANSITIONS: dict[str, dict[ViewState, frozenset[ViewState]]] = {
    # the first view, from `dsml.init`; messages held for it are delivered as it is
    # entered, and a peer's goodbye among them leaves this rank in MEMBER_LEFT at once
    "formed": {S.JOINING: frozenset({S.STEADY, S.MEMBER_LEFT})},
    # the registry's new view: members lost or left (no boundary), or joiners admitted
    # (a boundary agreed); a view no newer than what we know changes nothing
    "view": {
        **{s: frozenset({s, S.MEMBER_LOST, S.MEMBER_LEFT, S.JOIN_AGREED}) for s in _ANY},
        S.EVICTED: frozenset({S.EVICTED}),
    },
    # the registry proposes to admit joiners: say where we are, hold calls from there on
    "proposal": {
        **{s: frozenset({s, S.JOIN_PROPOSED}) for s in _ANY},
        S.EVICTED: frozenset({S.EVICTED}),
    },
    # a restarted registry asks us to register again: its proposal died with it
    "registry back": {
        **{s: frozenset({s}) for s in _ANY},
        S.JOIN_PROPOSED: frozenset({S.STEADY}),
        S.EVICTED: frozenset({S.EVICTED}),
    },
    # a peer's connection dropped and the registry did not rule in time
    "peer dropped": {
        **{s: frozenset({s, S.MEMBER_LOST, S.NO_QUORUM}) for s in _ANY},
        S.EVICTED: frozenset({S.EVICTED}),
    },
    # a peer said goodbye: calls up to its last run, the next fails once (a leave);
    # without the registry the survivors agree on the view without it (or lack quorum)
    "peer left": {
        **{s: frozenset({s, S.MEMBER_LEFT, S.MEMBER_LOST, S.NO_QUORUM}) for s in _ANY},
        S.EVICTED: frozenset({S.EVICTED}),
    },
    # the survivors agreed on a view without the registry (see survival.py)
    "agreed": {
        **{s: frozenset({s, S.MEMBER_LOST, S.MEMBER_LEFT}) for s in _ANY},
        S.EVICTED: frozenset({S.EVICTED}),
    },
    # members were lost without the registry and this side is no majority: calls fail
    # with NoQuorumError until the registry rules
    "no quorum": {**{s: frozenset({S.NO_QUORUM}) for s in _ANY}, S.EVICTED: frozenset({S.EVICTED})},
    # this rank was declared dead (an eviction of an older epoch changes nothing)
    "evicted": {**{s: frozenset({s, S.EVICTED}) for s in _ANY}, S.EVICTED: frozenset({S.EVICTED})},
    # a call boundary installed the next view (after a loss, a leave or an agreed join)
    "installed": {
        s: frozenset(
            {S.STEADY, S.JOIN_PROPOSED, S.JOIN_AGREED, S.MEMBER_LOST, S.MEMBER_LEFT, S.NO_QUORUM}
        )
        for s in {S.JOIN_AGREED, *_BROKEN}
    },
}


def transition(event: str) -> Callable[[F], F]:
    """Record the state change an event handler makes, and check it against the table."""

    def wrap(handler: F) -> F:
        @functools.wraps(handler)
        def handle(self: Any, *args: Any) -> Any:
            before = self.state
            result = handler(self, *args)
            after = self.state
            self.history.append((event, before, after))
            if after not in TRANSITIONS[event].get(before, frozenset()):
                log.error(
                    "view change %r led from %s to %s: not in TRANSITIONS", event, before, after
                )
            return result

        return handle  # type: ignore[return-value]

    return wrap


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
