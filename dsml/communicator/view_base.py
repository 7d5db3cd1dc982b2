"""What one rank knows about changes of membership, and the errors calls fail with
(communicator layer).

`ViewBase` holds the state that `ViewChanges` (view_changes.py) works on: the newest view
known, agreed joins waiting for their boundary, the gate a proposal sets, the loss that
broke the current epoch (`_Broken`), an eviction, a lack of quorum. From it follow the
named state (`state`, see view_states.py) and the errors a call fails with instead of
running (`PeerLostError`, `NoQuorumError`, `EvictedError`). The events that change the
state are in view_events.py; admitting calls and installing views in view_admission.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import DsmlError, EvictedError, NoQuorumError, PeerLostError
from ..membership import RegistryClient, View
from .call import Call
from .call_table import CallTable
from .links import PeerLinks
from .view_states import ViewState

if TYPE_CHECKING:
    from .survival import Survival

__all__ = ["ViewBase", "ViewListener"]

log = logging.getLogger("dsml.communicator")

ViewListener = Callable[[View, View], Any]


@dataclass(slots=True)
class _Broken:
    """The current epoch lost members: who, and up to which collective it still runs."""

    epoch: int
    lost: dict[int, str] = field(default_factory=dict)  # rank -> how it was lost
    limit: int = 0  # calls numbered up to this still run (members that left did them)
    owed: bool = False  # no call failed yet: the next one must
    only_left: bool = False  # members only left (closed): the call table raises their error


class ViewBase:
    """One rank's knowledge of membership changes; see the module docstring."""

    def __init__(
        self, table: CallTable, links: PeerLinks, registry: RegistryClient, view_timeout: float
    ) -> None:
        self.table = table
        self.links = links
        self.registry = registry
        self.view_timeout = view_timeout
        self.latest: View | None = links.view  # the newest view the registry sent
        self.interrupt_on_join = False  # elastic: the first call after a join raises
        self.listeners: list[ViewListener] = []
        self.installed = 0
        self._transitions: list[tuple[int, View]] = []  # agreed joins: (boundary, view)
        self._failed_view: View | None = None  # the view that ended the epoch abruptly
        self._gate: tuple[int, int] | None = None  # (epoch, cid) from which calls wait
        self._broken: _Broken | None = None
        self._evicted: str | None = None
        self._no_quorum: NoQuorumError | None = None  # lost without registry and majority
        #: decides losses while the registry is away (`use_survival`)
        self.survival: Survival | None = None
        self._changed = asyncio.Event()
        #: (event, state before, state after) of the latest events, oldest first
        self.history: deque[tuple[str, ViewState, ViewState]] = deque(maxlen=64)

    @property
    def state(self) -> ViewState:
        """The state this rank is in (derived from what it knows; see `TRANSITIONS`)."""
        if self._evicted is not None:
            return ViewState.EVICTED
        if self.links.view is None:
            return ViewState.JOINING
        broken = self._broken
        if broken is not None and broken.epoch == self.links.epoch:
            if self._no_quorum is not None:
                return ViewState.NO_QUORUM
            return ViewState.MEMBER_LEFT if broken.only_left else ViewState.MEMBER_LOST
        if self._transitions:
            return ViewState.JOIN_AGREED
        if self._gate is not None:
            return ViewState.JOIN_PROPOSED
        return ViewState.STEADY

    async def _next_change(self) -> None:
        self._changed.clear()
        await self._changed.wait()

    def _wake(self) -> None:
        self._changed.set()

    def _newest_epoch(self) -> int:
        return max(self.links.epoch, self.latest.epoch if self.latest is not None else 0)

    @property
    def evicted(self) -> bool:
        return self._evicted is not None

    @property
    def no_quorum(self) -> bool:
        return self._no_quorum is not None

    # -- errors ---------------------------------------------------------------------------------

    def sub_group_error(self) -> DsmlError | None:
        """The error a sub-group's call fails with while the installed epoch is broken
        (members lost, no quorum, this rank evicted); None while it is whole.

        Sub-groups end with their epoch: unlike this rank's own calls, theirs never move
        to the survivors' view, so each fails at once instead of waiting for lost peers.
        """
        state = self.state
        if state is ViewState.EVICTED:
            return self._evicted_error(None)
        if state is ViewState.NO_QUORUM:
            return self._no_quorum_error(None)
        if state is not ViewState.MEMBER_LOST:
            return None
        lost, epoch, names = self._lost()
        return PeerLostError(
            f"a sub-communicator's call did not run on root rank {self.links.rank}: the "
            f"group of epoch {epoch} lost {names or 'a member'}. Inputs are unchanged. "
            "Sub-communicators end with their epoch: once the survivors' view is in place "
            "(the root communicator's next call moves to it), split again",
            lost=sorted(r for r in lost if r >= 0),
            rank=self.links.rank,
            epoch=epoch,
        )

    def _lost(self) -> tuple[dict[int, str], int, str]:
        """(rank -> how it was lost, the broken epoch, the lost members described)."""
        broken = self._broken
        lost = dict(broken.lost) if broken is not None else {}
        epoch = broken.epoch if broken is not None else self.links.epoch
        view = self.links.view
        names = "; ".join(
            f"rank {r} ({view.members[r].describe()}): {why}"
            if view is not None and 0 <= r < view.size
            else why
            for r, why in sorted(lost.items())
        )
        return lost, epoch, names

    def _lost_error(self, call: Call | None) -> PeerLostError:
        lost, epoch, names = self._lost()
        what = (
            f"collective #{call.cid} {call.fingerprint.describe()}"
            if call is not None and call.cid
            else "this call"
        )
        when = "failed" if call is not None else "did not run"
        return PeerLostError(
            f"{what} {when} on rank {self.links.rank}: the group of epoch {epoch} lost "
            f"{names or 'a member'}. Inputs are unchanged. The next call runs in the new view "
            "of the survivors (restore and re-synchronise state first: dsml.elastic does it)",
            lost=sorted(r for r in lost if r >= 0),
            rank=self.links.rank,
            epoch=epoch,
            cid=call.cid if call is not None else None,
            collective=call.fingerprint.collective if call is not None else None,
        )

    def _no_quorum_error(self, call: Call | None) -> NoQuorumError:
        what = (
            f"collective #{call.cid} {call.fingerprint.describe()} failed on rank "
            f"{self.links.rank}: "
            if call is not None and call.cid
            else ""
        )
        return NoQuorumError(
            f"{what}{self._no_quorum}",
            rank=self.links.rank,
            epoch=self.links.epoch,
            cid=call.cid if call is not None else None,
            collective=call.fingerprint.collective if call is not None else None,
        )

    def _evicted_error(self, call: Call | None) -> EvictedError:
        return EvictedError(
            self._evicted or "this worker was evicted",
            rank=self.links.rank,
            epoch=self.links.epoch,
            cid=call.cid if call is not None else None,
            collective=call.fingerprint.collective if call is not None else None,
        )
