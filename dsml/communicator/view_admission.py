"""Admitting calls and installing views, for one rank (communicator layer).

`ViewAdmission` decides whether the next collective can start at once (`immediate`), or
waits and installs the next view first (`admit`): after a loss the first call fails once
and the next one waits for the survivors' view; after an agreed join the call at the
boundary waits for the old epoch's calls, then runs first in the new view. It also tells
the application which view the next call runs in (`next_view`, `pending_view`,
`wait_known`).
"""

from __future__ import annotations

import asyncio
import logging

from ..errors import MembershipChangedError, PeerLostError
from ..membership import View
from .view_base import ViewBase
from .view_states import transition

__all__ = ["ViewAdmission"]

log = logging.getLogger("dsml.communicator")


class ViewAdmission(ViewBase):
    """When calls may start, and the installing of views; see the module docstring."""

    # -- admission ----------------------------------------------------------------------------

    def immediate(self) -> bool:
        """Whether the next collective can start now, with no view work to do first."""
        if self._evicted is not None or self._broken is not None:
            return False
        cid = self.table.next_cid
        if self._transitions and cid >= self._transitions[0][0]:
            return False
        return self._gate is None or (self.links.epoch, cid) < self._gate

    async def admit(self) -> None:
        """Wait until the next collective id may be used; install views on
        the way. Raises the error a call must fail with instead of running."""
        while True:
            if self._evicted is not None:
                raise self._evicted_error(None)
            cid = self.table.next_cid
            broken = self._broken
            if broken is not None and broken.epoch == self.links.epoch:
                if cid <= broken.limit:
                    return
                if self._no_quorum is not None:
                    broken.owed = False
                    raise self._no_quorum_error(None)
                if broken.owed:
                    broken.owed = False
                    if not broken.only_left:
                        raise self._lost_error(None)
                    return  # a leave: the call fails at its start (that member closed)
                await self._install(await self._newer_view())
                continue
            if self._transitions and cid >= self._transitions[0][0]:
                _boundary, view = self._transitions[0]  # _apply takes it off the list
                await self._install(view)
                if self.interrupt_on_join:
                    raise MembershipChangedError(
                        f"the group changed to {view.size} members at epoch {view.epoch} "
                        "(members joined); state must be synchronised again",
                        rank=self.links.rank,
                        epoch=view.epoch,
                    )
                continue
            if self._gate is not None and (self.links.epoch, cid) >= self._gate:
                await self._next_change()
                continue
            return

    def ensure_current(self) -> None:
        """For point-to-point calls (no collective id): fail, or move to the new view now.

        After members only left (closed their communicators), point-to-point calls go on
        in the current view: messages sent before a close are still delivered, and a call
        naming a member that closed fails saying so. After a loss the first call fails
        (unless one already did), and the next one moves to the survivors' view.
        """
        if self._evicted is not None:
            raise self._evicted_error(None)
        broken = self._broken
        if broken is None or broken.epoch != self.links.epoch or broken.only_left:
            return
        if broken.owed and not broken.only_left:
            broken.owed = False
            raise self._lost_error(None)
        latest = self._failed_view
        if latest is None or latest.epoch <= self.links.epoch or self.table.calls:
            raise MembershipChangedError(
                f"the group is changing after epoch {self.links.epoch} lost members; "
                "point-to-point calls resume once the new view is in place (try again)",
                rank=self.links.rank,
                epoch=self.links.epoch,
            )
        self._apply(latest)

    async def _newer_view(self) -> View:
        try:
            async with asyncio.timeout(self.view_timeout):
                while self._failed_view is None or self._failed_view.epoch <= self.links.epoch:
                    if self._evicted is not None:
                        raise self._evicted_error(None)
                    if self._no_quorum is not None:
                        raise self._no_quorum_error(None)
                    await self._next_change()
        except TimeoutError:
            raise PeerLostError(
                f"rank {self.links.rank} lost members of epoch {self.links.epoch} and no new "
                f"view came from the registry at {self.registry.address} within "
                f"{self.view_timeout:g} s: is the registry running?",
                lost=sorted(self._broken.lost) if self._broken else (),
                rank=self.links.rank,
                epoch=self.links.epoch,
            ) from None
        return self._failed_view

    async def _install(self, view: View) -> None:
        """Wait for this epoch's calls to end, then install `view`."""
        while self.table.calls:
            tasks = [c.task for c in self.table.calls.values() if c.task is not None]
            if not tasks:
                break
            await asyncio.wait(tasks)
            await asyncio.sleep(0)  # let the calls' done callbacks forget them
        self._apply(view)

    @transition("installed")
    def _apply(self, view: View) -> None:
        old = self.links.view
        assert old is not None
        self.table.fail_all(
            lambda call: MembershipChangedError(
                f"recv from rank {call.peer} was pending when the group moved to epoch "
                f"{view.epoch}; point-to-point messages do not cross a change of view",
                rank=self.links.rank,
                epoch=old.epoch,
                collective="recv",
            )
        )
        self.table.enter(view)
        self.links.enter(view)
        if self._transitions and self._transitions[0][1] is view:
            self._transitions.pop(0)  # the agreed join this install completes
        self.installed += 1
        self._no_quorum = None
        if self._broken is not None and self._broken.epoch < view.epoch:
            self._broken = None
        if self.latest is None or self.latest.epoch < view.epoch:
            self.latest = view
        log.info("epoch %d: rank %d of %d", view.epoch, self.links.rank, view.size)
        beacon = self.registry.beacon
        if beacon is not None:
            beacon.beat_now()
        for listener in list(self.listeners):
            try:
                listener(old, view)
            except Exception:
                log.exception("a view listener failed")

    # -- for the application --------------------------------------------------------------------

    def next_view(self) -> View:
        """The view the next collective will run in, as far as this rank knows now."""
        view = self.links.view
        assert view is not None
        broken, failed = self._broken, self._failed_view
        if broken is not None and not broken.only_left and failed is not None:
            return failed if failed.epoch > view.epoch else view
        if (
            broken is not None
            and broken.only_left
            and failed is not None
            and failed.epoch > view.epoch
            and not broken.owed
            and self.table.next_cid > broken.limit
        ):
            return failed  # a leave: the calls of the old view are over here
        if self._transitions and self.table.next_cid >= self._transitions[0][0]:
            return self._transitions[0][1]
        return view

    def pending_view(self) -> View | None:
        """A newer view known but not installed yet (None if none)."""
        latest = self.latest
        if self._transitions:
            return self._transitions[-1][1]
        if latest is not None and self.links.view is not None and latest.epoch > self.links.epoch:
            return latest
        return None

    async def wait_known(self, timeout: float | None = None) -> View:  # noqa: ASYNC109
        """Wait until a view newer than the installed one is known; returns it."""
        async with asyncio.timeout(timeout):
            while self.pending_view() is None:
                if self._evicted is not None:
                    raise self._evicted_error(None)
                await self._next_change()
        view = self.pending_view()
        assert view is not None
        return view
