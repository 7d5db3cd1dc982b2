"""The same-host shared-memory plane of one communicator (collectives layer).

`SameHost` knows, for the current view, which members share this host's memory (same
host name and host identity: boot id and /dev/shm device), and keeps the `ShmLink` to
them for that epoch, connected lazily inside the first call that uses it (so timeouts
and aborts apply). A new view closes the old link; the new one removes orphans of dead
processes when it is made. `run` gives an algorithm a `ShmCall` (the `ShmGroup` of one
call) and marks the call done or given up on the link, so peers waiting on this rank
stop waiting at once when it fails.

Members record a host identity only when shared memory is on (`DSML_SHM=0` publishes an
empty one), so every rank decides alike from the view whether a group is all on one host.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..transport.shm_link import INLINE_BYTES, Check, LinkPeer, ShmLink, Unless
from ..transport.shm_segment import ShmFullError

__all__ = ["HostMember", "SameHost", "ShmCall"]

log = logging.getLogger("dsml.shm")
T = TypeVar("T")
OnWait = Callable[[int, float], None]


@dataclass(frozen=True, slots=True)
class HostMember:
    """What the plane needs of a member of the view."""

    member: str
    host: str
    host_id: str  # empty: shared memory off for this member
    pid: int


class ShmCall:
    """One call's `ShmGroup` over a link: it numbers the call's syncs."""

    def __init__(
        self,
        link: ShmLink,
        cid: int,
        record: bytes,
        check: Check | None,
        unless: Unless,
        on_wait: OnWait | None = None,
    ) -> None:
        self._link = link
        self._cid = cid
        self._record: bytes | None = record
        self._check = check
        self._unless = unless
        self._on_wait = on_wait
        self._phase = 0

    @property
    def rank(self) -> int:
        return self._link.me

    @property
    def size(self) -> int:
        return self._link.size

    @property
    def inline_bytes(self) -> int:
        return INLINE_BYTES

    def reserve(self, results_bytes: int, staging_bytes: int) -> bool:
        return self._link.reserve(results_bytes, staging_bytes)

    def area(self, rank: int) -> Any:
        return self._link.area(rank)

    def inline(self, rank: int) -> Any:
        return self._link.inline(rank, self._cid)

    def inlines(self) -> list[Any]:
        return self._link.inlines(self._cid)

    async def sync(self, ok: bool = True) -> bool:
        self._phase += 1
        record, self._record = self._record, None
        start = time.perf_counter()
        try:
            return await self._link.sync(
                self._cid, self._phase, record, ok, self._check, self._unless
            )
        finally:
            if self._on_wait is not None:
                self._on_wait(self._phase, time.perf_counter() - start)


class SameHost:
    """See the module docstring."""

    def __init__(
        self, *, enabled: bool, stage_bytes: int, max_data_bytes: int, spin_s: float = 5e-3
    ) -> None:
        self.enabled = enabled
        self.stage_bytes = stage_bytes
        self.max_data_bytes = max_data_bytes
        self._spin_s = spin_s
        self._members: list[HostMember] = []
        self._me = -1
        self._epoch = 0
        self._link: ShmLink | None = None
        #: why this epoch has no link (a rank had no room for its end), once known: every
        #: call of the epoch then goes over TCP, on every rank alike
        self._no_room: ShmFullError | None = None
        self._warned = False
        self.calls = 0  # calls run in shared memory (tests and diagnosis)
        #: fault injection (dsml.testing): members whose data link is cut, by member id
        self.cut: Callable[[str], bool] | None = None

    def set_view(self, epoch: int, members: Sequence[HostMember], me: int) -> None:
        """Adopt a view (members in rank order, `me` this rank); drops the old link and,
        where a call can use one (the whole group on this host, or hosts with as many
        ranks each), makes this rank's end of the new one now, so peers find it early.
        Not otherwise: a link no call uses would keep its names in /dev/shm (they are
        removed once the peers mapped them, at the first call) for a crash to leave."""
        self.close()
        self._epoch, self._members, self._me = epoch, list(members), me
        if len(self.local_ranks) > 1 and (self.all_local or self.ring_ranks() is not None):
            with contextlib.suppress(ShmFullError):  # the first call that needs it says so
                self._make_link()

    @property
    def local_ranks(self) -> list[int]:
        """Ranks of the view that share memory with this rank (this rank included)."""
        if not self.enabled or self._me < 0:
            return []
        mine = self._members[self._me]
        if not mine.host_id:
            return []
        return [
            r
            for r, m in enumerate(self._members)
            if m.host == mine.host and m.host_id == mine.host_id
        ]

    def ring_ranks(self) -> list[int] | None:
        """For a hierarchical call: the ranks with this rank's local index on every host
        (in host order), or None unless every host has the same number (>= 1) of ranks
        sharing memory and there are at least two hosts."""
        if not self.enabled or self._me < 0 or not all(m.host_id for m in self._members):
            return None
        hosts: dict[tuple[str, str], list[int]] = {}
        for rank, m in enumerate(self._members):
            hosts.setdefault((m.host, m.host_id), []).append(rank)
        sizes = {len(ranks) for ranks in hosts.values()}
        if len(hosts) < 2 or len(sizes) != 1:
            return None
        index = self.local_ranks.index(self._me)
        return [ranks[index] for ranks in hosts.values()]

    @property
    def all_local(self) -> bool:
        """Whether the whole group (two or more) shares this host's memory."""
        return len(self._members) > 1 and len(self.local_ranks) == len(self._members)

    async def run(
        self,
        cid: int,
        record: bytes,
        algorithm: Callable[[ShmCall], Awaitable[T]],
        check: Check | None = None,
        unless: Unless = None,
        on_wait: OnWait | None = None,
    ) -> T:
        """Run `algorithm` on this call's ShmGroup; marks the call done or given up.

        `record` (the call's fingerprint bytes) is compared with every peer's at the first
        sync; `check(peer, theirs)` says what error a different record means; every wait
        ends raising the result of `unless` once it is done (the call failed);
        `on_wait(phase, seconds)` hears how long each sync waited."""
        link = await self._connected(unless)
        link.cut = self.cut
        self.calls += 1
        if link.in_process:
            # Ranks of one process (dsml.testing): let the others start their calls (and
            # deadlines) before this one works, as separate processes would.
            await asyncio.sleep(0)
        try:
            await link.begin(cid, unless)
            result = await algorithm(ShmCall(link, cid, record, check, unless, on_wait))
        except BaseException:
            link.abandon(cid)
            raise
        link.complete(cid)
        return result

    async def _connected(self, unless: Unless) -> ShmLink:
        """The connected link; ShmFullError when this epoch has none for want of room on
        some rank (that rank leaves a marker its peers see, so all of them agree)."""
        if self._no_room is not None:
            raise self._no_room
        link = self._link if self._link is not None else self._make_link()
        if not link.connected:
            try:
                await link.wait_connected(unless)
            except ShmFullError as exc:
                self._no_room = exc
                raise
        return link

    def _make_link(self) -> ShmLink:
        ranks = self.local_ranks
        peers = [LinkPeer(self._members[r].member, self._members[r].pid, r) for r in ranks]
        link = ShmLink(
            ranks.index(self._me),
            peers,
            self._epoch,
            max_data_bytes=self.max_data_bytes,
            spin_s=self._spin_s,
        )
        self._link = link  # kept when it fails: its marker tells the peers, until close()
        try:
            link.create()
        except ShmFullError as exc:
            self._no_room = exc
            raise
        return link

    def warn_no_link(self, error: ShmFullError) -> None:
        """Say once per communicator that this epoch's calls go over TCP: some rank had no
        room for its end of the link."""
        if not self._warned:
            self._warned = True
            log.warning(
                "no room in shared memory for this host's link (%s): collectives go over "
                "TCP on every rank until the group changes. Free /dev/shm, give the "
                "container a larger one (e.g. docker --shm-size=1g), or set DSML_SHM=0",
                error.strerror or error,
            )

    def warn_no_room(self, nbytes: int) -> None:
        """Say once per communicator that an array went over TCP for want of room."""
        if not self._warned:
            self._warned = True
            log.warning(
                "no room in shared memory for a %d-byte collective: it (and others like it) "
                "go over TCP. A rank's segment may take at most shm_max_bytes (%d, "
                "CommConfig) and what /dev/shm has free; raise shm_max_bytes, give the "
                "container a larger /dev/shm (e.g. docker --shm-size=1g), or set DSML_SHM=0",
                nbytes,
                self.max_data_bytes,
            )

    def close(self) -> None:
        """Unmap the link and remove this rank's segments."""
        self._no_room = None
        if self._link is not None:
            self._link.close()
            self._link = None

    def __repr__(self) -> str:
        state = "off" if not self.enabled else f"local={self.local_ranks}"
        return f"<SameHost epoch={self._epoch} {state} link={self._link!r}>"
