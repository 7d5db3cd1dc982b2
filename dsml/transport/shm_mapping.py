"""Setting up and mapping the segments of a shared-memory link (transport layer).

Every local rank owns two segments: a small *control* segment of counters that only it
writes (one word per peer excepted, see `MAPPED`), and a *data* segment that grows on
demand (a new segment, a new generation, when a call needs more room). `ShmMapping`
holds one rank's end of the link and its state: it creates this rank's control segment,
maps every peer's (`wait_connected`), makes room in this rank's data area (`reserve`),
installs the data segments it maps, unlinks names once every peer has mapped them (a
peer writes the generation it mapped into its own control segment), and unmaps
everything on `close`. The layout of a control segment is the constants below.

Synchronisation over these segments, and the entry records of calls, are `ShmLink`'s
(shm_link.py).
"""

from __future__ import annotations

import asyncio
import errno
import gc
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np

from ..errors import ProtocolError
from .shm_segment import SHM_DIR, Segment, ShmFullError, segment_name, sweep_orphans
from .shm_wake import Waker

__all__ = ["INLINE_BYTES", "MAX_LOCAL", "LinkPeer", "ShmMapping", "Unless"]

#: a future whose result is the error that ends the call (None: nothing to watch)
Unless: TypeAlias = "asyncio.Future[BaseException] | None"

HEADER_BYTES = 4096
INLINE_BYTES = 1 << 20  # two inline areas (one per record slot) for small calls
CONTROL_BYTES = HEADER_BYTES + 2 * INLINE_BYTES
MAGIC = 0x6473_6D6C_7368_6D31  # "dsmlshm1"
# control words (int64)
W_MAGIC, W_PROGRESS, W_LAST_OK, W_GEN, W_DATA_BYTES, W_SLEEPING = 0, 1, 2, 3, 4, 5
MAPPED = 1280 // 8  # word index: MAPPED + j = generation of rank j's data this rank mapped
MAX_LOCAL = (HEADER_BYTES - 1280) // 8
MIN_DATA_BYTES = 256 << 10
PURE_SPIN_S = 50e-6  # a peer this close behind is worth keeping the CPU for


def _cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _raise_if_done(unless: Unless) -> None:
    if unless is not None and unless.done():
        raise unless.result()


@dataclass(frozen=True, slots=True)
class LinkPeer:
    """A member of the host's group: its rank in the link, member id and process id."""

    member: str
    pid: int
    rank: int  # its rank in the whole group (for error messages)


class ShmMapping:
    """One local rank's segments and maps; see the module docstring. `ShmLink` adds the
    synchronisation."""

    def __init__(
        self,
        me: int,
        peers: Sequence[LinkPeer],
        epoch: int,
        *,
        max_data_bytes: int,
        spin_s: float = 5e-3,
    ) -> None:
        assert len(peers) <= MAX_LOCAL
        self.me = me
        self.peers = list(peers)
        self.size = len(peers)
        self.epoch = epoch
        self.max_data_bytes = max_data_bytes
        #: every rank in this process (dsml.testing clusters): waiting must not spin
        self.in_process = all(p.pid == os.getpid() for p in peers)
        self._spin_s = 0.0 if self.in_process else spin_s
        # More local ranks than CPUs: a peer we wait for needs our CPU to get there, so
        # yield from the first look (measured: less time lost at 4 ranks on 2 cores).
        self._pure_spin_s = PURE_SPIN_S if self.size <= _cpus() else 0.0
        self._control: list[Segment | None] = [None] * self.size
        self._words: list[Any] = [None] * self.size
        #: each rank's two inline areas (one per record slot), as uint8
        self._inline_slots: list[Any] = [None] * self.size
        #: each rank's header words as an int64 memoryview: the counters read and written
        #: on every call (a memoryview item is a plain int, several times faster to read
        #: than a numpy scalar); released before the segments close
        self._wv: list[Any] = [None] * self.size
        self._raw: list[Any] = [None] * self.size  # control segments as uint8
        #: this call's entry record of each rank, once read (see `ShmLink._read_record`)
        self._records: list[tuple[int, bool, bytes, int, int] | None] = [None] * self.size
        self._data: list[Segment | None] = [None] * self.size
        self._areas: list[Any] = [None] * self.size
        self._gens = [0] * self.size  # generation of each rank's data mapped here
        self._waker: Waker | None = None
        self._results_hw = 0  # own data area: bytes at its start that held results
        self._count = 0  # calls begun: they alternate between two record slots
        self._used = [0, 0]  # the call that last used each slot (and inline area)
        self._slot = 0
        self._cid = 0
        #: (fingerprint bytes, ok, data generation) last written into each record slot
        self._written: list[tuple[bytes, bool, int] | None] = [None, None]
        self.closed = False
        #: the empty file saying this rank had no room for its control segment, if so
        self._marker: Path | None = None
        #: fault injection (dsml.testing): a cut peer's (member id) progress never shows
        self.cut: Callable[[str], bool] | None = None

    # -- setup ------------------------------------------------------------------------------

    def _name(self, rank: int, kind: str) -> str:
        peer = self.peers[rank]
        return segment_name(peer.pid, peer.member, self.epoch, kind)

    def create(self) -> None:
        """Make this rank's control segment (after removing orphans of dead processes)."""
        sweep_orphans()
        try:
            seg = Segment.create(self._name(self.me, "c"), CONTROL_BYTES)
        except ShmFullError:
            self._leave_no_room_marker()
            raise
        words = np.frombuffer(seg.map, dtype=np.int64, count=HEADER_BYTES // 8)
        words[MAPPED : MAPPED + MAX_LOCAL] = -1
        words[W_MAGIC] = MAGIC
        self._control[self.me], self._words[self.me] = seg, words
        self._map_views(self.me, seg)
        self._waker = Waker(self._name(self.me, "w"))
        self._wake_names = [b"\0" + self._name(r, "w").encode() for r in range(self.size)]

    def _leave_no_room_marker(self) -> None:
        """Say to the peers that this rank has no control segment for want of room: an
        empty file (it takes an inode, no space), so that every rank of the link gives
        the link up for this epoch, not only this one (see `wait_connected`)."""
        path = SHM_DIR / self._name(self.me, "n")
        try:
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        except OSError:
            return  # not even an inode: the peers' first call times out, naming this rank
        self._marker = path

    def _check_no_room(self, rank: int) -> None:
        """Raise ShmFullError if rank said it has no room for its control segment."""
        if (SHM_DIR / self._name(rank, "n")).exists():
            raise ShmFullError(
                errno.ENOSPC,
                f"rank {self.peers[rank].rank} found no room in {SHM_DIR} for its "
                "shared-memory link",
            )

    async def wait_connected(self, unless: Unless = None) -> None:
        """Map every peer's control segment (they may still be starting); ShmFullError
        when a peer had no room for its own (it left a marker saying so)."""
        assert self._waker is not None
        self._waker.start()
        delay = 1e-4
        while True:
            for rank in range(self.size):
                if self._control[rank] is None:
                    self._map_control(rank)
                if self._control[rank] is None:
                    self._check_no_room(rank)
            if all(c is not None for c in self._control):
                return
            if unless is None:
                await asyncio.sleep(delay)
            else:
                await asyncio.wait([unless], timeout=delay)
                _raise_if_done(unless)
            delay = min(delay * 2, 5e-3)

    def _map_control(self, rank: int) -> None:
        try:
            seg = Segment.open(self._name(rank, "c"))
        except PermissionError:
            raise ProtocolError(
                f"cannot open the shared memory of rank {self.peers[rank].rank} on this host "
                "(does it run as another user?); run every rank of a host as one user, or "
                "set DSML_SHM=0"
            ) from None
        if seg is None or seg.size < CONTROL_BYTES:
            return
        words = np.frombuffer(seg.map, dtype=np.int64, count=HEADER_BYTES // 8)
        if words[W_MAGIC] != MAGIC:
            del words
            seg.close()
            return
        self._control[rank], self._words[rank] = seg, words
        self._map_views(rank, seg)
        self._words[self.me][MAPPED + rank] = 0

    def _map_views(self, rank: int, seg: Segment) -> None:
        raw = np.frombuffer(seg.map, np.uint8)
        self._raw[rank] = raw
        self._inline_slots[rank] = tuple(
            raw[HEADER_BYTES + slot * INLINE_BYTES : HEADER_BYTES + (slot + 1) * INLINE_BYTES]
            for slot in (0, 1)
        )
        self._wv[rank] = memoryview(seg.map)[:HEADER_BYTES].cast("q")

    @property
    def connected(self) -> bool:
        return all(c is not None for c in self._control)

    # -- data areas -------------------------------------------------------------------------

    def reserve(self, results_bytes: int, staging_bytes: int) -> bool:
        """Make room in this rank's data area for a call's results (at its start) and
        staging (at its end); False when /dev/shm has no room (or it would exceed
        `max_data_bytes`).

        Staging must not overlap results of the previous call, which slower peers may
        still be copying out: within one segment, results up to their high-water mark
        stay clear of it. A larger need makes a new segment (the next generation); peers
        map it at this call's first sync.
        """
        own = self._data[self.me]
        if own is not None and own.size >= max(self._results_hw, results_bytes) + staging_bytes:
            self._results_hw = max(self._results_hw, results_bytes)
            return True
        nbytes = results_bytes + staging_bytes
        if nbytes > self.max_data_bytes:
            return False
        size = max(nbytes, MIN_DATA_BYTES, 2 * own.size if own is not None else 0)
        for attempt in (min(size, self.max_data_bytes), nbytes):
            gen = self._gens[self.me] + 1
            try:
                seg = Segment.create(self._name(self.me, f"d{gen}"), attempt)
            except ShmFullError:
                continue
            self._install(self.me, seg, gen)
            self._results_hw = results_bytes
            words = self._words[self.me]
            words[W_DATA_BYTES] = seg.size
            words[W_GEN] = gen  # for diagnosis: peers take the generation from entry records
            return True
        return False

    def area(self, rank: int) -> Any:
        """Rank's data area as uint8 (mapped as of this rank's last completed sync)."""
        return self._areas[rank]

    def _install(self, rank: int, seg: Segment, gen: int) -> None:
        old = self._data[rank]
        self._data[rank], self._areas[rank], self._gens[rank] = (
            seg,
            np.frombuffer(seg.map, np.uint8),
            gen,
        )
        if old is not None:
            old.close()

    def _unlink_mapped(self) -> None:
        me = self.me
        control, own = self._control[me], self._data[me]
        if (control is None or not control.linked) and (own is None or not own.linked):
            return  # the usual case: every name is gone already
        seen = min(
            (int(self._words[r][MAPPED + me]) for r in range(self.size) if r != me), default=0
        )
        control = self._control[me]
        if seen >= 0 and control is not None and control.linked:
            control.unlink()
        own = self._data[me]
        if own is not None and own.linked and seen >= self._gens[me]:
            own.unlink()

    # -- closing ----------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap everything and remove this rank's names."""
        if self.closed:
            return
        self.closed = True
        self._words = [None] * self.size
        self._inline_slots = [None] * self.size
        for view in self._wv:
            if view is not None:
                view.release()
        self._wv = [None] * self.size
        self._raw = [None] * self.size
        self._records = [None] * self.size
        self._areas = [None] * self.size
        segments = [seg for seg in [*self._control, *self._data] if seg is not None]
        held = [seg for seg in segments if not seg.close()]  # close() says if it unmapped
        if held:
            # Views still alive: most often locals of a failed call's traceback, which is
            # a reference cycle; collect it now rather than keep each map's descriptor
            # until the cyclic GC happens to run (a daemon worker runs job after job).
            gc.collect()
            for seg in held:
                seg.close()
        self._control = [None] * self.size
        self._data = [None] * self.size
        if self._waker is not None:
            self._waker.close()
        if self._marker is not None:
            self._marker.unlink(missing_ok=True)
            self._marker = None

    def __repr__(self) -> str:
        return (
            f"<ShmLink rank {self.me}/{self.size} epoch={self.epoch} "
            f"connected={self.connected} data_gen={self._gens[self.me]}>"
        )
