"""The shared-memory link between the members of one host in one epoch (transport layer).

Every local rank owns two segments: a small *control* segment of counters that only it
writes (one word per peer excepted, see `MAPPED`), and a *data* segment that grows on
demand (a new segment, a new generation, when a call needs more room). Peers map both
and read them directly; algorithms reduce straight out of a peer's data segment.

Synchronisation is by counters, no messages. A rank's `PROGRESS` word holds
`cid * 256 + phase`: it has reached `phase` of collective `cid` (phase 255: it gave that
call up). `sync` posts the next phase and waits until every peer has posted it. Waiting
spins (for the first 50 us without yielding, then yielding the CPU between looks, so an
oversubscribed host still moves; with more local ranks than CPUs, yielding at once) for
up to `spin_s`, then sleeps on the event loop until a peer's wake-up datagram
(`shm_wake.py`) arrives; while it sleeps, the mesh can fail the call (a peer lost over
TCP, an abort), which cancels the wait. When peers are prompt, nothing on this path goes
through the event loop.

The first sync of a call also carries the call's *entry record*: its collective id, the
caller's fingerprint (its wire bytes), whether the caller found room for its data, and
the generation of its data segment for this call (a faster peer may already have grown
its segment for the next call: readers map the generation of the record, not the
newest). Every rank compares every peer's record with its own, so ranks that called
different collectives fail with `CollectiveMismatchError` as they would over TCP.
Records (and the inline areas for small calls) alternate between two slots; `begin`
reuses a slot only once every peer has left the call that used it last.

Segment names are unlinked as soon as every peer has mapped them (a peer writes the
generation it mapped into its own control segment), so a crash leaves no file behind.

Setting up and mapping the segments (and closing them) is `ShmMapping`'s (shm_mapping.py,
with the layout of a control segment); `ShmLink` adds the synchronisation, the entry
records and the mapping of each call's data generations.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

from ..errors import CollectiveAbortedError, CollectiveMismatchError, ProtocolError
from .shm_mapping import (
    INLINE_BYTES,
    MAPPED,
    W_LAST_OK,
    W_PROGRESS,
    W_SLEEPING,
    LinkPeer,
    ShmMapping,
    Unless,
    _raise_if_done,
)
from .shm_records import FP_MAX, Record, find_record, write_cid, write_record
from .shm_segment import Segment

__all__ = ["FAILED", "INLINE_BYTES", "Check", "LinkPeer", "ShmLink", "Unless"]

#: (peer's rank, its entry record) -> the error to raise, or None when compatible
Check = Callable[[int, bytes], BaseException | None]

FAILED = 255
_PHASES = 256
#: The first sleep without a look at the peers' counters. A wake-up is lost only when a
#: peer posts while this rank announces that it sleeps (each side can miss the other's
#: word); a later post sees the announcement and wakes it. So the sleeps double, up to
#: BACKSTOP_MAX_S, each look announcing again: a rank waiting long for a late peer
#: looked 500 times a second (about 3% of a CPU) with the sleep fixed at 2 ms.
BACKSTOP_S = 2e-3
BACKSTOP_MAX_S = 0.064
GIVE_UP_GRACE_S = 0.25  # a peer gave a call up and no call failure to watch: then fail


class _GaveUp(Exception):
    def __init__(self, rank: int) -> None:
        self.rank = rank


class ShmLink(ShmMapping):
    """One local rank's end of the link; see the module docstring."""

    def inline(self, rank: int, cid: int) -> Any:
        """Rank's inline area for call `cid` (INLINE_BYTES as uint8, in its control segment;
        a peer's only once this call's first sync is over: its record says which)."""
        if rank == self.me:
            assert cid == self._cid
            slot = self._slot
        else:
            slot = self._read_record(rank, cid)[4]
            if slot < 0:
                raise ProtocolError(f"rank {self.peers[rank].rank} has no entry for #{cid}")
        return self._inline_slots[rank][slot]

    def inlines(self, cid: int) -> list[Any]:
        """Every rank's inline area for call `cid`, in rank order (see `inline`)."""
        assert cid == self._cid
        records = self._records
        if None in records:  # not all read yet (the first sync reads them all)
            return [self.inline(rank, cid) for rank in range(self.size)]
        slots = self._inline_slots
        return [slots[rank][rec[4]] for rank, rec in enumerate(records)]  # type: ignore[index]

    def _map_data(self, cid: int) -> None:
        """Map the data generation each peer uses in call `cid` (from its entry record:
        a faster peer may already have grown its area for the next call)."""
        mine = self._words[self.me]
        for rank in range(self.size):
            if rank == self.me:
                continue
            known = self._records[rank]
            gen = (known if known is not None else self._read_record(rank, cid))[3]
            if gen != self._gens[rank]:
                seg = Segment.open(self._name(rank, f"d{gen}"))
                if seg is None:
                    raise ProtocolError(
                        f"rank {self.peers[rank].rank}'s shared-memory segment {gen} vanished"
                    )
                self._install(rank, seg, gen)
                mine[MAPPED + rank] = gen
        self._unlink_mapped()

    # -- synchronisation --------------------------------------------------------------------

    async def begin(self, cid: int, unless: Unless = None) -> None:
        """Start call `cid` on this rank: take the record slot and inline area not used by
        the previous call, once every peer has left the call that used them last.

        Peers read a call's record and inline area after its first sync; a peer may lag
        behind by more than a call (the calls between may need no word from it, over TCP),
        so the slot is reused only when nobody can still be reading it.
        """
        slot = self._count % 2
        self._count += 1
        used = self._used[slot]
        if used and not self._all_past(used):
            await self._wait(lambda rank: self._left(rank, used), unless)
        self._used[slot], self._slot, self._cid = cid, slot, cid
        self._records = [None] * self.size

    async def sync(
        self,
        cid: int,
        phase: int,
        record: bytes | None = None,
        ok: bool = True,
        check: Check | None = None,
        unless: Unless = None,
    ) -> bool:
        """Post (cid, phase) and wait for every peer to post it; True when all were ok.

        With `record` (the caller's fingerprint bytes) this is the call's first sync: the
        entry records are written and compared; `check(peer rank, their record)` gives the
        error to raise for a record unlike ours (None: compatible).
        """
        assert 0 < phase < FAILED
        assert cid == self._cid, "begin(cid) first"
        if record is not None:
            self._write_record(cid, record, ok)
        target = cid * _PHASES + phase
        self._wv[self.me][W_PROGRESS] = target
        self._wake_sleepers()
        try:
            if not self._all_at(target, target - phase + FAILED):
                await self._wait(lambda rank: self._reached(rank, cid, phase), unless)
        except _GaveUp as gave_up:
            await self._peer_gave_up(gave_up.rank, cid, record, check, unless)
        except Exception:
            if record is not None:  # a mismatch seen here says more than a peer's abort
                self._check_records(cid, record, check, present_only=True)
            raise
        if record is None:
            self._unlink_mapped()
            return True
        all_ok = self._check_records(cid, record, check)
        self._map_data(cid)
        return all_ok

    async def _peer_gave_up(
        self, rank: int, cid: int, record: bytes | None, check: Check | None, unless: Unless
    ) -> None:
        """A peer failed this call: raise its reason if we can tell it, else wait for the
        call's failure to arrive (`unless`), which carries the real reason.

        The wait has no grace period of its own: a peer that gives a call up either tells
        us over TCP (an abort, a goodbye) or is lost (a crash: its connection drops and
        the group's view changes), and the call's deadline bounds both. A shorter grace
        would turn a crashed peer into a `CollectiveAbortedError` on the survivors that
        noticed first, instead of the `PeerLostError` everyone else gets.
        """
        if record is not None:  # a mismatch, seen here too
            self._check_records(cid, record, check, present_only=True)
        if unless is not None:
            await asyncio.wait([unless])
            _raise_if_done(unless)
        else:
            await asyncio.sleep(GIVE_UP_GRACE_S)
        raise CollectiveAbortedError(
            f"rank {self.peers[rank].rank} gave up collective #{cid} (its own error says why)",
            origin=self.peers[rank].rank,
            rank=self.peers[self.me].rank,
            epoch=self.epoch,
            cid=cid,
        )

    def complete(self, cid: int) -> None:
        """This rank finished call `cid` successfully."""
        self._wv[self.me][W_LAST_OK] = cid

    def abandon(self, cid: int) -> None:
        """This rank gave call `cid` up: peers waiting on it stop waiting."""
        if self._words[self.me] is not None:
            self._words[self.me][W_PROGRESS] = cid * _PHASES + FAILED
            self._wake_sleepers()

    def _wake_sleepers(self) -> None:
        assert self._waker is not None
        me = self.me
        for rank, words in enumerate(self._wv):
            if rank != me and words is not None and words[W_SLEEPING]:
                self._waker.wake(self._wake_names[rank])

    def _all_at(self, low: int, high: int) -> bool:
        """Whether every peer's progress is in [low, high): the quick look before a
        wait (the usual case when the peers are prompt; `_reached` tells the rest)."""
        if self.cut is not None:
            return False
        me = self.me
        for rank, words in enumerate(self._wv):
            if rank != me and not low <= words[W_PROGRESS] < high:
                return False
        return True

    def _all_past(self, cid: int) -> bool:
        """Whether every peer has gone on past call `cid` (the quick look of `begin`)."""
        if self.cut is not None:
            return False
        me, after = self.me, (cid + 1) * _PHASES
        for rank, words in enumerate(self._wv):
            if rank != me and words[W_PROGRESS] < after:
                return False
        return True

    def _reached(self, rank: int, cid: int, phase: int) -> bool:
        words = self._words[rank]
        progress = int(words[W_PROGRESS])
        at, step = divmod(progress, _PHASES)
        if at < cid:
            return False
        if at == cid and step != FAILED:
            return step >= phase
        if at > cid and int(words[W_LAST_OK]) >= cid:
            return True  # it finished this call and went on
        raise _GaveUp(rank)

    async def _wait(self, ready: Callable[[int], bool], unless: Unless) -> None:
        """Spin for up to spin_s (yielding the CPU after the first PURE_SPIN_S, or at once
        when the host has fewer CPUs than local ranks), then sleep until a peer wakes us;
        raise the result of `unless` once it is done (the call failed)."""
        pending = [r for r in range(self.size) if r != self.me]
        if self.cut is not None:
            ready = self._uncut(ready, self.cut)
        start = time.perf_counter()
        while True:
            _raise_if_done(unless)
            pending = [r for r in pending if not ready(r)]
            if not pending:
                return
            waited = time.perf_counter() - start
            if waited > self._spin_s:
                break
            if waited > self._pure_spin_s:
                os.sched_yield()
        assert self._waker is not None
        mine = self._words[self.me]
        backstop = BACKSTOP_S
        try:
            while True:
                self._waker.arm()
                mine[W_SLEEPING] = 1
                pending = [r for r in pending if not ready(r)]
                if not pending:
                    return
                await self._waker.wait(backstop, unless)
                _raise_if_done(unless)
                backstop = min(2 * backstop, BACKSTOP_MAX_S)
        finally:
            mine[W_SLEEPING] = 0

    def _uncut(
        self, ready: Callable[[int], bool], cut: Callable[[str], bool]
    ) -> Callable[[int], bool]:
        """`ready`, blind to peers whose link is cut (a partition: as if their writes to
        this host's memory never arrived; see dsml.testing.faults)."""
        return lambda rank: not cut(self.peers[rank].member) and ready(rank)

    def _left(self, rank: int, cid: int) -> bool:
        """Whether rank is done with call cid (finished, gave up, or moved on)."""
        words = self._words[rank]
        at, step = divmod(int(words[W_PROGRESS]), _PHASES)
        return at > cid or (at == cid and step == FAILED) or int(words[W_LAST_OK]) >= cid

    def _write_record(self, cid: int, record: bytes, ok: bool) -> None:
        slot, fields = self._slot, (record, ok, self._gens[self.me])
        if self._written[slot] == fields:  # a repeated call: only its cid is new
            write_cid(self._raw[self.me], slot, cid)
        else:
            self._written[slot] = fields
            write_record(self._raw[self.me], slot, Record(cid, ok, record, fields[2]))
        # What `_read_record` would find; a long fingerprint is stored hashed: read it back.
        entry = (cid, ok, record, fields[2], slot)
        self._records[self.me] = entry if len(record) <= FP_MAX else None

    def _read_record(self, rank: int, cid: int) -> tuple[int, bool, bytes, int, int]:
        """(cid, ok, fingerprint bytes, data generation, slot) of rank's entry record for
        call cid; cid -1 and slot -1 when it has none. A record found for the current call
        is kept: it does not change before every rank has left the call (see `begin`)."""
        if cid == self._cid:
            known = self._records[rank]
            if known is not None:
                return known
        raw = self._raw[rank]
        assert raw is not None
        found = find_record(raw, cid, self._slot)
        if found is None:
            return -1, False, b"", 0, -1
        slot, rec = found
        entry = rec.cid, rec.ok, rec.fingerprint, rec.gen, slot
        if cid == self._cid:
            self._records[rank] = entry
        return entry

    def _check_records(
        self, cid: int, record: bytes, check: Check | None, *, present_only: bool = False
    ) -> bool:
        all_ok = bool(self._read_record(self.me, cid)[1])
        for rank in range(self.size):
            if rank == self.me:
                continue
            their_cid, ok, theirs, _gen, _slot = self._read_record(rank, cid)
            if their_cid != cid and present_only:
                continue
            if their_cid != cid:
                raise ProtocolError(f"rank {self.peers[rank].rank} has no entry for #{cid}")
            if theirs != record:
                self._mismatch(rank, cid, theirs, check)
            all_ok = all_ok and ok
        return all_ok

    def _mismatch(self, rank: int, cid: int, theirs: bytes, check: Check | None) -> None:
        peer = self.peers[rank].rank
        if check is not None:
            error = check(peer, theirs)
            if error is None:
                return  # byte-different but compatible (fields unknown to one side)
            raise error
        me = self.peers[self.me].rank
        raise CollectiveMismatchError(
            f"collective #{cid}: rank {me} and rank {peer} called different collectives "
            "or passed different arguments; every rank must make the same calls in the "
            "same order",
            ranks=(me, peer),
            rank=me,
            epoch=self.epoch,
            cid=cid,
        )
