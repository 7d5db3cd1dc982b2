"""The communicator's one hook into the same-host shared-memory plane (communicator).

`ShmHook` follows the views (which members share this host), and runs the shared-memory
algorithms for a `Call`: the call's fingerprint travels as its entry record, so ranks
that called different collectives fail with `CollectiveMismatchError` as over TCP; a
failure marks the call given up in shared memory (peers stop waiting at once) and is
reported to the peers over TCP by the runner, as for any other algorithm.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgpack

from ..collectives import NUMPY, ArrayBackend, ReduceOp
from ..collectives.all_reduce_hierarchical import all_reduce_hierarchical
from ..collectives.all_reduce_shm import all_reduce_shm
from ..collectives.collectives_shm import all_gather_shm, broadcast_shm, reduce_scatter_shm
from ..collectives.group import Lane, Receipt, Received
from ..collectives.shm_plane import HostMember, SameHost, ShmCall
from ..config import CommConfig
from ..errors import CollectiveAbortedError, CollectiveMismatchError, ProtocolError
from ..membership import Member, View
from ..transport.addresses import host_of
from ..transport.shm_segment import ShmFullError
from ..wire import Fingerprint
from . import stats
from .call import Call
from .call_table import CallTable
from .diagnose import mismatch_message

__all__ = ["ShmHook"]

T = TypeVar("T")
Array = Any


class ShmHook:
    """See the module docstring."""

    def __init__(self, config: CommConfig, table: CallTable) -> None:
        self._member_id = table.links.member_id
        self._table = table
        self._claimed: list[tuple[int, int]] = []  # (epoch, cid) of calls planned for shm
        self._finished: asyncio.Future[None] | None = None  # resolved as a call ends
        #: the last fingerprint's entry record (msgpack), made once for repeated calls
        self._record_of: tuple[Fingerprint | None, bytes] = (None, b"")
        self._stage_bytes = config.shm_stage_bytes
        #: more processes share this host's memory than it has CPUs (see `_run`)
        self._crowded = False
        self._all_local = False  # the view's whole group shares this host's memory
        #: the view's hierarchical ring (this rank's peers with its local index), if any
        self._ring_ranks: list[int] | None = None
        self._local_peers = False  # some other rank of the view shares this host's memory
        self.plane = SameHost(
            enabled=config.shm,
            stage_bytes=config.shm_stage_bytes,
            max_data_bytes=config.shm_max_bytes,
        )

    def set_view(self, view: View) -> None:
        """Follow a new view (at a collective boundary)."""
        rank = view.rank_of(self._member_id)
        assert rank is not None
        members = [HostMember(m.id, _where(m), m.host_id, m.pid) for m in view.members]
        self.plane.set_view(view.epoch, members, rank)
        local = self.plane.local_ranks
        self._all_local = self.plane.all_local
        self._ring_ranks = self.plane.ring_ranks()  # once per view: planning stays cheap
        self._local_peers = len(local) > 1
        self._crowded = len({members[r].pid for r in local}) > _cpus()

    def claim(self, be: ArrayBackend) -> bool:
        """Whether the call being planned (on arrays of this backend) runs in shared
        memory; the answer depends only on the view and the array type, so every rank
        gives the same. If so, the call takes its turn (see `_wait_turn`)."""
        return self._all_local and _is_numpy(be) and self._take_turn()

    def claim_hierarchical(self, be: ArrayBackend, auto: bool = False) -> bool:
        """Like `claim`, for a hierarchical all_reduce (several hosts, as many ranks each).
        For `auto` only where hosts run two ranks or more: with one rank per host the
        hierarchical all_reduce is the ring between hosts, and the turn it would take
        only costs the call (same answer on every rank: it depends on the view)."""
        if self._ring_ranks is None or not _is_numpy(be):
            return False
        return (self._local_peers or not auto) and self._take_turn()

    def weighs_hierarchical(self) -> bool:
        """Whether `auto` weighs the hierarchical all_reduce for numpy arrays in this view
        (what `claim_hierarchical(be, auto=True)` answers, without taking a turn)."""
        return self._ring_ranks is not None and bool(self._local_peers)

    def _take_turn(self) -> bool:
        # Planning happens right after the runner numbered the call, in program order.
        self._claimed.append((self._table.epoch, self._table.next_cid - 1))
        return True

    async def _wait_turn(self, call: Call) -> None:
        """Wait until this rank's earlier shared-memory calls are over: the link runs one
        call at a time, in collective order on every rank, while TCP calls may overlap."""
        if self._claimed and self._claimed[0] == (call.epoch, call.cid):
            return  # the usual case: no earlier call claimed the link
        while True:
            live = self._table.calls
            self._claimed = [key for key in self._claimed if key in live]
            if not any(key < (call.epoch, call.cid) for key in self._claimed):
                return
            if self._finished is None:
                self._finished = asyncio.get_running_loop().create_future()
            # a timeout too: a call that failed before running ends without telling us
            waits = (self._finished, call.failed)
            await asyncio.wait(waits, timeout=0.01, return_when=asyncio.FIRST_COMPLETED)
            if call.failure is not None:
                raise call.failure

    async def all_reduce(self, call: Call, src: Array, dst: Array, op: ReduceOp) -> bool:
        """dst = all-reduce of src in shared memory; False (nothing written) for want of room."""

        def algorithm(group: ShmCall) -> Awaitable[bool]:
            return all_reduce_shm(group, src, dst, op, self._stage_bytes)

        done = await self._run(call, algorithm, False)
        if not done:
            self.plane.warn_no_room(src.nbytes)
        return done

    async def all_reduce_hierarchical(
        self, call: Call, src: Array, dst: Array, op: ReduceOp
    ) -> None:
        """dst = all-reduce of src: shared memory in each host, a ring between hosts."""
        ranks = self._ring_ranks
        assert ranks is not None
        ring = _Ring(call, ranks)

        def algorithm(group: ShmCall) -> Awaitable[bool]:
            return all_reduce_hierarchical(group, ring, src, dst, op, self._stage_bytes)

        if not await self._run(call, algorithm, False):
            raise CollectiveAbortedError(
                f"rank {call.rank} has no room in /dev/shm for a {src.nbytes}-byte "
                "hierarchical all_reduce; enlarge /dev/shm or raise shm_max_bytes, or use "
                "algorithm='ring'",
                origin=call.rank,
                rank=call.rank,
                epoch=call.epoch,
                cid=call.cid,
            )

    async def barrier(self, call: Call) -> bool:
        """Wait for every rank; False (not waited) when this epoch has no link."""
        return await self._run(call, lambda group: group.sync(), False)

    async def broadcast(self, call: Call, buf: Array, root: int) -> bool:
        """The root's buf into every rank's buf; False (nothing written) for want of room."""
        done = await self._run(
            call, lambda group: broadcast_shm(group, buf, root, self._stage_bytes), False
        )
        if not done:
            self.plane.warn_no_room(buf.nbytes)
        return done

    async def all_gather(
        self, call: Call, block: Array, rows: int, trailing: tuple[int, ...]
    ) -> Array | None:
        """Every rank's block concatenated (a new array); None for want of room."""
        result = await self._run(
            call, lambda group: all_gather_shm(group, block, rows, trailing), None
        )
        if result is None:
            self.plane.warn_no_room(block.nbytes)
        return result

    async def reduce_scatter(
        self, call: Call, src: Array, spans: list[tuple[int, int]], op: ReduceOp
    ) -> Array | None:
        """This rank's reduced span of src (a new flat array); None for want of room."""
        result = await self._run(
            call,
            lambda group: reduce_scatter_shm(group, src, spans, op, self._stage_bytes),
            None,
        )
        if result is None:
            self.plane.warn_no_room(src.nbytes)
        return result

    async def _run(self, call: Call, algorithm: Callable[[ShmCall], Awaitable[T]], no_link: T) -> T:
        """Run algorithm in shared memory; `no_link` (nothing done) when this epoch has no
        link for want of room on some rank: every rank learns it alike (shm_plane.py), so
        every rank runs the call over TCP instead, with one warning."""
        fp = call.fingerprint
        if fp is not self._record_of[0]:  # plans reuse the fingerprint of repeated calls
            # The staging size too: it sets how the data is cut into pieces, so ranks
            # with different shm_stage_bytes would read each other's areas wrongly.
            self._record_of = (fp, msgpack.packb([fp.to_wire(), self._stage_bytes]))
        record = self._record_of[1]
        stage = self._stage_bytes

        def check(peer: int, theirs: bytes) -> CollectiveMismatchError | None:
            return _mismatch(call, peer, theirs, stage)

        await self._wait_turn(call)
        if self._crowded:
            # Fewer CPUs than ranks: a peer on this CPU may still be finishing the
            # previous call (it saw the last sync after us). Let it finish before our
            # work for this one; else it finishes only once we wait, and the call ends
            # on every rank a whole call's work later.
            os.sched_yield()
        self.plane.cut = self._table.links.cut  # fault injection (dsml.testing), else None
        try:
            return await self.plane.run(
                call.cid, record, algorithm, check, call.failed, _count_wait
            )
        except ShmFullError as exc:
            self.plane.warn_no_link(exc)
            return no_link
        finally:
            self.release(call)

    def release(self, call: Call) -> None:
        """The call no longer holds its turn (it ran, or it runs over TCP after all, as an
        auto call that could have run hierarchical may): wake the calls waiting on it."""
        with contextlib.suppress(ValueError):
            self._claimed.remove((call.epoch, call.cid))
        if self._finished is not None and not self._finished.done():
            self._finished.set_result(None)
        self._finished = None

    def close(self) -> None:
        self.plane.close()

    def __repr__(self) -> str:
        return f"<ShmHook {self.plane!r}>"


def _where(member: Member) -> str:
    """Host name and advertised IP: ranks of one machine that advertise different
    addresses count as different hosts (as the cost model and the multi-host test
    harness see them), so they talk over TCP (or `hierarchical`) rather than share memory."""
    return f"{member.host}/{host_of(member.address)}"


def _count_wait(phase: int, seconds: float) -> None:
    """comm.stats(): the first sync of a call waits for the peers to arrive, the others
    for their work (the shared-memory counterpart of the wire)."""
    record = stats.current.get()
    if record is not None:
        if phase == 1:
            record.waiting_s += seconds
        else:
            record.wire_s += seconds


def _cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _is_numpy(be: ArrayBackend) -> bool:
    """numpy arrays (the backend may be wrapped, e.g. to time its work): shared memory
    holds host memory only."""
    return be is NUMPY or getattr(be, "inner", None) is NUMPY


class _Ring:
    """The Group of a hierarchical call's ring between hosts: `ranks[i]` is ring rank i."""

    def __init__(self, call: Call, ranks: list[int]) -> None:
        self._call = call
        self._ranks = ranks
        self.rank = ranks.index(call.rank)
        self.size = len(ranks)
        self.chunk_bytes = call.chunk_bytes

    async def send(
        self,
        peer: int,
        step: int,
        chunk: int = 0,
        payload: memoryview | None = None,
        *,
        meta: dict[str, Any] | None = None,
        lane: Lane = Lane.DATA,
    ) -> Receipt:
        return await self._call.send(self._ranks[peer], step, chunk, payload, meta=meta, lane=lane)

    async def recv(
        self,
        peer: int,
        step: int,
        chunk: int = 0,
        *,
        nbytes: int | None = None,
        lane: Lane = Lane.DATA,
    ) -> Received:
        return await self._call.recv(self._ranks[peer], step, chunk, nbytes=nbytes, lane=lane)


def _mismatch(call: Call, peer: int, theirs: bytes, stage: int) -> CollectiveMismatchError | None:
    """The error for a peer's entry record ([fingerprint, shm_stage_bytes]) unlike this
    call's (None: compatible)."""
    try:
        wire, their_stage = msgpack.unpackb(theirs)
        other = Fingerprint.from_wire(wire)
    except (ProtocolError, ValueError, TypeError, msgpack.UnpackException):
        other, their_stage = Fingerprint("(an unreadable or overlong fingerprint)"), stage
    if not call.fingerprint.conflicts(other):
        if their_stage == stage:
            return None
        message = (
            f"collective #{call.cid} cannot run in shared memory: rank {call.rank} has "
            f"shm_stage_bytes={stage} but rank {peer} has {their_stage!r}; give every rank "
            "the same CommConfig(shm_stage_bytes=...)"
        )
    else:
        message = mismatch_message(call.cid, call.rank, call.fingerprint, peer, other)
    return CollectiveMismatchError(
        message,
        ranks=(call.rank, peer),
        rank=call.rank,
        epoch=call.epoch,
        cid=call.cid,
        collective=call.fingerprint.collective,
    )
