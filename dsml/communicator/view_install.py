"""Entering a new view: what installing it does outside the view machine (communicator).

`ViewChanges` (view_changes.py) installs a view at a call boundary, once the old epoch's
calls are over: `enter_view` fails the receives still pending (point-to-point messages
do not cross a change of view) and has the call table and then the links enter the view
(which may deliver messages held for it); once `ViewChanges` has updated what it knows,
`announce_view` sends the registry a heartbeat at once and tells the application's
listeners. Neither keeps state.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..errors import MembershipChangedError
from ..membership import RegistryClient, View

if TYPE_CHECKING:
    from .call_table import CallTable
    from .links import PeerLinks
    from .view_states import ViewListener

__all__ = ["announce_view", "enter_view"]

log = logging.getLogger("dsml.communicator")


def enter_view(table: CallTable, links: PeerLinks, old: View, view: View) -> None:
    """Move the call table and the links from `old` to `view`."""
    table.fail_all(
        lambda call: MembershipChangedError(
            f"recv from rank {call.peer} was pending when the group moved to epoch "
            f"{view.epoch}; point-to-point messages do not cross a change of view",
            rank=links.rank,
            epoch=old.epoch,
            collective="recv",
        )
    )
    table.enter(view)
    links.enter(view)


def announce_view(
    registry: RegistryClient,
    links: PeerLinks,
    listeners: list[ViewListener],
    old: View,
    view: View,
) -> None:
    """Say that `view` is installed: the log, the registry (a beat now), the listeners."""
    log.info("epoch %d: rank %d of %d", view.epoch, links.rank, view.size)
    beacon = registry.beacon
    if beacon is not None:
        beacon.beat_now()
    for listener in list(listeners):
        try:
            listener(old, view)
        except Exception:
            log.exception("a view listener failed")
