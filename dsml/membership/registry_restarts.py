"""Restarts, and views agreed without the registry (membership layer).

`RegistryRestarts` takes a member's report of its view (REJOIN: after a registry restart,
or from a member at a newer epoch than the registry) and the survivors' VIEW_AGREED, and
adopts such a view if it descends from the registry's own (a subset, in the same ring
order); members it leaves out are told they were evicted.
"""

from __future__ import annotations

import logging
import time

from ..errors import ProtocolError
from ..wire import Envelope, Fields, Kind
from .liveness import Liveness
from .registry_core import RegistryCore
from .view import Change, View

__all__ = ["RegistryRestarts"]

log = logging.getLogger("dsml.registry")


class RegistryRestarts(RegistryCore):
    """The registry's handlers of reported and agreed views."""

    # -- restarts ---------------------------------------------------------------------------

    def handle_rejoin(self, sender: bytes, env: Envelope) -> None:
        """A member reports its view: the registry restarted, or the member is at a newer
        epoch than the registry (its survivors agreed on a view while it was away)."""
        member_id = self._member_of(sender)
        view = View.from_wire(Fields(env.body, "Rejoin").get_map("view"))
        if view.rank_of(member_id) is None:
            raise ProtocolError("Rejoin: the view does not list its sender")
        self._adopt(member_id, view, "as its members report it")

    def handle_view_agreed(self, sender: bytes, env: Envelope) -> None:
        """Survivors agreed on `view` without the registry: adopt it if it descends from
        the registry's own view."""
        member_id = self._member_of(sender)
        fields = Fields(env.body, "ViewAgreed")
        view = View.from_wire(fields.get_map("view"))
        if view.rank_of(member_id) is None:
            raise ProtocolError("ViewAgreed: the view does not list its sender")
        self._adopt(member_id, view, "agreed by the survivors while the registry was away")

    def _adopt(self, member_id: str, view: View, how: str) -> None:
        now = time.monotonic()
        current = self._view
        if current is None or view.epoch > self._epoch:
            if current is not None and not _descends(current, view):
                # Not a successor of ours (a member of some other history): it is not ours.
                self._reply(
                    member_id.encode(),
                    Kind.EVICTED,
                    {"epoch": self._epoch, "reason": "its view is not one of this group's"},
                )
                return
            self._take(view, how, now)
        elif view.epoch < self._epoch or current.rank_of(member_id) is None:
            self._reply(
                member_id.encode(),
                Kind.EVICTED,
                {"epoch": self._epoch, "reason": "the group moved on"},
            )
            return
        elif view.members != current.members:
            # Same epoch, other members: the registry published its own view meanwhile.
            # One more epoch, of the members both views share, settles it for everyone.
            lost = [m.id for m in current.members if view.rank_of(m.id) is None]
            self._remove(lost, [], f"settling two views of epoch {view.epoch}")
            return
        live = self._live.get(member_id)
        if live is not None:
            live.last_seen = now
            live.epoch = max(live.epoch, view.epoch)

    def _take(self, view: View, how: str, now: float) -> None:
        """Make `view` the registry's view as it is (same epoch: members already run it)."""
        previous = self._view
        lost = [m.id for m in previous.members if view.rank_of(m.id) is None] if previous else []
        log.warning(
            "adopting epoch %d of %d members, %s%s",
            view.epoch,
            view.size,
            how,
            f" (without {', '.join(lost)})" if lost else "",
        )
        self.adopted += 1 if previous is not None else 0
        self._view, self._epoch = view, view.epoch
        self.view_log.add(view.epoch, view.size, Change(), f"adopted: {how}")
        self._reports.clear()
        self._proposal = None  # answers to a proposal refer to an epoch that is over
        self._change = Change(
            previous=previous.epoch if previous else view.epoch,
            lost=tuple(lost),
            heartbeat_interval=self.config.heartbeat_interval,
            heartbeat_timeout=self.config.heartbeat_timeout,
        )
        self._live = {m.id: Liveness(last_seen=now, view_sent=now) for m in view.members}
        self._started_at = now  # a full timeout of grace for everyone to report in
        # Reports of silent peers queued while the registry was away describe a past
        # that the adopted view already settled: they only get the connection check.
        self._reports_from = now + self.config.heartbeat_timeout
        for member_id in lost:
            self._evicted[member_id] = view.epoch
            reason = f"the other members went on without it at epoch {view.epoch}"
            self._reply(member_id.encode(), Kind.EVICTED, {"epoch": view.epoch, "reason": reason})
        if previous is not None:
            for member in view.members:  # stragglers learn it; the others ignore it
                self._send_view(member.id, view, self._change)
        if self._pending:
            self._schedule_proposal()


def _descends(old: View, new: View) -> bool:
    """Whether `new` keeps only members of `old`, in `old`'s ring order."""
    ranks = [old.rank_of(m.id) for m in new.members]
    return None not in ranks and ranks == sorted(ranks)  # type: ignore[type-var]
