"""Liveness, as the registry judges it (membership layer).

`RegistryLiveness` takes heartbeats (with each member's progress and message counters),
runs the watchdog that declares silent members dead (only under the rules of
`liveness`: with a majority heard, and never for the registry's own stall), and checks the
members' reports of a suspect peer: dead at once if its own connection to the registry is
gone too, cut off if most of those that watch it (its overlay neighbours) lost their links
to it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ..errors import ProtocolError
from ..wire import Envelope, Fields, Kind
from .live import read_summary
from .liveness import StallDetector, evictable
from .peerwatch import overlay
from .registry_core import _HB, RegistryCore
from .view import Change

__all__ = ["RegistryLiveness"]

log = logging.getLogger("dsml.registry")

_SUSPECT_CHECKS_S = (0.02, 0.05, 0.1, 0.2, 0.4)  # delays of the re-checks of a suspect
_LAST_WORDS_S = 0.05  # after a connection is gone, time to read what it sent before
#: a member dropped on its peers' reports waits this long for reports of others lost with it
#: (a host's ranks die together: one view change for all of them)
_GATHER_S = 0.025
_CUT_OFF = "cut off"  # the reason of a member dropped on reports, worded at its removal


class RegistryLiveness(RegistryCore):
    """The registry's handlers of heartbeats and suspects, and its watchdog."""

    # -- liveness ---------------------------------------------------------------------------

    def handle_heartbeat(self, sender: bytes, env: Envelope) -> None:
        if not sender.endswith(_HB):
            raise ProtocolError("a heartbeat must come from a heartbeat identity")
        member_id = sender[: -len(_HB)].decode(errors="replace")
        fields = Fields(env.body, "Heartbeat")
        epoch = fields.get_int("epoch")
        started = _progress(fields, "started")
        finished = _progress(fields, "finished")
        counters = _counters(env.body)
        progress = read_summary((env.body or {}).get("summary"))  # Fields checked: a map
        live = self._live.get(member_id)
        if live is not None:
            now = time.monotonic()
            live.last_seen = now
            live.epoch, live.started, live.finished = epoch, started, finished
            live.counters = counters
            live.progress = progress
            live.beats += 1
            self._reply(member_id.encode(), Kind.HEARTBEAT_ACK, {"epoch": self._epoch})
            if self._view is None:
                return
            if epoch > self._view.epoch and now - live.asked_view > self.config.heartbeat_interval:
                # The survivors agreed on a view while this registry was away: ask for it.
                live.asked_view = now
                self._reply(member_id.encode(), Kind.REREGISTER, self._settings())
            elif (
                epoch < self._view.epoch
                and now - live.view_sent > 2 * self.config.heartbeat_interval
            ):
                # It may never have got the view (its channel was reconnecting): again.
                live.view_sent = now
                self._send_view(member_id, self._view, self._change)
        elif member_id in self._evicted:
            evicted_at = self._evicted[member_id]
            self._reply(
                member_id.encode(),
                Kind.EVICTED,
                {"epoch": evicted_at, "reason": "it was declared dead (silent for too long)"},
            )
        elif epoch > 0 and member_id not in self._pending and member_id not in self._joining:
            self._reply(member_id.encode(), Kind.REREGISTER, self._settings())  # a restart

    async def _watchdog(self) -> None:
        """Declare dead the members silent for longer than the heartbeat timeout (see
        `liveness`: only with a majority heard, and never for the registry's own stall)."""
        period = min(self.config.heartbeat_interval, self.config.heartbeat_timeout / 4)
        stall = StallDetector(period, tolerance=period / 2)
        stall.tick(time.monotonic())
        while True:
            await asyncio.sleep(period)
            late = stall.tick(time.monotonic())
            if late:
                self._stalled(late)
            for name in self.pool.expire(self.config.heartbeat_timeout):
                log.warning("worker %s stopped sending heartbeats; no longer listed", name)
            self._evict_silent()

    def _stalled(self, late: float) -> None:
        """The registry did not run for `late` seconds: that silence is not the members'."""
        self.stalls += 1
        for live in self._live.values():
            live.last_seen += late
        if late > self.config.heartbeat_timeout / 2:
            log.warning(
                "the registry did not run for %.1f s (stopped, or its host hung); "
                "re-learning the members before anyone can be declared dead",
                late,
            )
            self._started_at = time.monotonic()  # a full timeout of grace, as after a restart
            self._reports_from = self._started_at + self.config.heartbeat_timeout

    def _evict_silent(self) -> None:
        if self._view is None:
            return
        now = time.monotonic()
        if now < self._started_at + self.config.heartbeat_timeout:
            return
        assert self._endpoint is not None
        endpoint = self._endpoint
        silent, kept = evictable(
            [m.id for m in self._view.members],
            self._live,
            now,
            self.config.heartbeat_timeout,
            lambda member: endpoint.reachable(member.encode(), Envelope(Kind.PING)),
        )
        if kept:
            self.kept_silent += 1
            if self.kept_silent == 1 or self.kept_silent % 50 == 0:
                log.warning(
                    "no heartbeat from %s for %g s, but they are a majority of the group "
                    "and still connected: the registry may be the one cut off, and they may "
                    "run on without it, so nobody is evicted for it",
                    ", ".join(kept),
                    self.config.heartbeat_timeout,
                )
        if silent:
            self._remove(
                silent,
                [],
                f"no heartbeat from {', '.join(silent)} for {self.config.heartbeat_timeout:g} s",
            )

    def handle_suspect(self, sender: bytes, env: Envelope) -> None:
        fields = Fields(env.body, "Suspect")
        suspect = fields.get_str("member", 64)
        epoch = fields.get_int("epoch")
        reporter = self._member_of(sender)
        view = self._view
        if view is None or epoch > self._epoch or view.rank_of(reporter) is None:
            return
        if view.rank_of(suspect) is None or suspect in self._removing:
            return  # already gone, or about to be
        if epoch == self._epoch and suspect != reporter and time.monotonic() >= self._reports_from:
            reporters = self._reports.setdefault(suspect, set())
            reporters.add(reporter)
            rank = view.rank_of(suspect)
            assert rank is not None
            watchers = {view.members[r].id for r in overlay(view.size, rank)}
            if 2 * len(reporters & watchers) > len(watchers):
                # Most of those that watch it (`peerwatch.overlay`; the whole group up to
                # 2k + 1) lost their links to it: cut off from the group, even if it still
                # reaches the registry (the data path is what it is for).
                self._remove_lost(suspect, _CUT_OFF, gather=_GATHER_S)
                return
        if suspect in self._suspects:
            return  # being checked (a report about an older epoch may still be news)
        self._suspects.add(suspect)
        self._spawn(self._check_suspect(suspect, self._epoch, reporter))

    async def _check_suspect(self, suspect: str, epoch: int, reporter: str) -> None:
        """Declare `suspect` dead if its own connection to the registry is gone too.

        A process that died closes every connection at once; the registry's may just be
        noticed a moment later than the peer's, hence a few re-checks. A suspect still
        connected after them is alive: the epoch is renewed with the same members, so the
        reporter, which gave up its calls with that peer, can go on.
        """
        assert self._endpoint is not None
        try:
            for delay in (0.0, *_SUSPECT_CHECKS_S):
                await asyncio.sleep(delay)
                if self._view is None or self._view.rank_of(suspect) is None:
                    return  # removed meanwhile (left, or found dead another way)
                if suspect in self._removing:
                    continue  # in a removal being gathered: look again after it
                if not self._reachable(suspect):
                    # Its last messages (a LeaveRequest) may still wait in our queue: the
                    # connection can be gone before the reader got to them.
                    await asyncio.sleep(_LAST_WORDS_S)
                    if self._view is None or self._view.rank_of(suspect) is None:
                        return  # it left properly
                    if suspect not in self._removing:
                        self._remove_lost(
                            suspect, f"member {suspect} disconnected (reported by {reporter})"
                        )
                    return
            if self._view is not None and self._epoch == epoch:  # else a new view went out
                log.warning("member %s is still connected; renewing epoch %d", suspect, epoch)
                self._publish(self._view.members, Change(previous=self._epoch))
        finally:
            self._suspects.discard(suspect)

    def _remove_lost(self, member: str, reason: str, gather: float = 0.0) -> None:
        """End the epoch without `member`, and without the other reported members that are
        lost too: a host that dies takes all its ranks at once, and a program should see
        one view change (one error per survivor) for it, not one per rank, which an
        elastic program restores from each. `gather`: first wait that long for reports of
        others (a member cut off is dropped on reports alone, and the reports about a
        second rank can come just after the majority about the first); a removal decided
        meanwhile joins this one. With reported companions, after `_LAST_WORDS_S` more
        (their last messages, a LeaveRequest, may still be queued: one that left
        meanwhile is not counted dead); alone and without `gather`, at once."""
        if self._batch is not None:
            self._batch.setdefault(member, reason)
            self._removing.add(member)
            return
        companions = self._companions()
        if member in companions:
            companions.remove(member)
        if not companions and not gather:
            self._remove([member], [], self._why(member, reason, self._view))
            return
        self._batch = {member: reason}
        self._removing.update([member, *companions])
        self._spawn(self._remove_batch(companions, gather))

    def _companions(self) -> list[str]:
        """The members reported lost (our own link to one may not have dropped yet) and in
        no removal already."""
        view = self._view
        assert view is not None
        return [
            m
            for m in sorted(self._suspects | set(self._reports))
            if m not in self._removing and view.rank_of(m) is not None
        ]

    async def _remove_batch(self, companions: list[str], gather: float) -> None:
        batch = self._batch
        assert batch is not None
        try:
            if gather:
                await asyncio.sleep(gather)
                if self._view is None:
                    return
                more = self._companions()
                self._removing.update(more)
                companions += more
            companions = [m for m in companions if m not in batch]
            if companions:
                await asyncio.sleep(_LAST_WORDS_S)
            view = self._view
            if view is None:
                return
            also = [m for m in companions if view.rank_of(m) is not None and self._lost(m, view)]
            decided = [m for m in batch if view.rank_of(m) is not None]
            if decided or also:
                reason = "; ".join(self._why(m, batch[m], view) for m in decided)
                if also:
                    reason += f"; with {'them' if len(decided) > 1 else 'it'} "
                    reason += f"{', '.join(also)}, lost at the same time"
                self._remove(decided + also, [], reason)
        finally:
            self._batch = None
            self._removing.difference_update([*batch, *companions])

    def _why(self, member: str, reason: str, view: Any) -> str:
        """The reason given for a member's removal; for one dropped on reports: dead (its
        connection to the registry is gone too), else cut off, with the address the
        reporters could not reach (an interface they have no route to is a usual cause)."""
        if reason != _CUT_OFF:
            return reason
        reporters = len(self._reports.get(member, ()))
        if not self._reachable(member):
            return f"member {member} disconnected (reported by {reporters} of its peers)"
        index = view.rank_of(member)
        address = view.members[index].address if index is not None else "?"
        return (
            f"member {member} is cut off from the group ({reporters} of {view.size - 1} "
            f"members lost their links to it, or never reached the address it gave them, "
            f"{address}: if that address is not reachable from their hosts, choose another "
            "with DSML_IFNAME or DSML_BIND)"
        )

    def _lost(self, member: str, view: Any) -> bool:
        """Disconnected from the registry, or cut off from most of the group."""
        cut_off = 2 * len(self._reports.get(member, ())) > view.size - 1
        return cut_off or not self._reachable(member)

    def _reachable(self, member: str) -> bool:
        assert self._endpoint is not None
        return self._endpoint.reachable(member.encode(), Envelope(Kind.PING))


def _counters(body: Any) -> dict[str, int]:
    """A heartbeat's message counters (held, dropped, ...): a small map of counts."""
    raw = body.get("counters") if isinstance(body, dict) else None
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > 16:
        raise ProtocolError("Heartbeat.counters must be a map of at most 16 counts")
    for key, number in raw.items():
        if type(key) is not str or len(key) > 32 or type(number) is not int or number < 0:
            raise ProtocolError("Heartbeat.counters maps short names to counts")
    return dict(raw)


def _progress(fields: Fields, key: str) -> list[Any] | None:
    """A heartbeat's [epoch, cid, description] of a collective, or None."""
    value = fields.get_list(key, 3, optional=True)
    if value is None:
        return None
    if len(value) != 3 or type(value[0]) is not int or type(value[1]) is not int:
        raise ProtocolError(f"Heartbeat.{key} must be [epoch, cid, description]")
    if type(value[2]) is not str or len(value[2]) > 256:
        raise ProtocolError(f"Heartbeat.{key} description must be a short string")
    return list(value)
