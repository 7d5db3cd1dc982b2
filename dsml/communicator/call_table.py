"""The calls of one rank: collective ids, calls in flight, failure delivery (communicator).

The runner is the only writer of the table. It takes collective ids from it in program
order (`take_cid`), registers each call, and forgets it when it ends. The peer links hand
the table every peer message of the installed view (`inbound`); it routes data into the
mailbox by `(epoch, cid, sender rank, lane)` and, on the way, checks the sender's
fingerprint against the call this rank made under that id: a mismatch fails the call at
once and aborts it everywhere. An abort, a goodbye, a lost peer fail calls by putting the
error where they wait (`Call.fail`); nothing here cancels a task.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from ..collectives.group import Lane
from ..config import CommConfig
from ..errors import (
    GAVE_UP,
    CollectiveAbortedError,
    CollectiveError,
    CollectiveMismatchError,
    MemberLeftError,
    ProtocolError,
)
from ..membership import View
from ..transport import Mailbox
from ..wire import Envelope, Fields, Fingerprint, Kind
from .call import Call
from .diagnose import abort_body, error_from_abort, goodbye_message, mismatch_message
from .links import Inbound, PeerLinks
from .waiting import WaitingFor

__all__ = ["PEER_LEFT", "CallTable"]

_MAX_AHEAD = 1 << 20  # how far past our newest call a peer's collective id may be
_LANES = {Kind.CHUNK: Lane.DATA, Kind.CONFIRM: Lane.CONFIRM}

Item = tuple[Envelope, list[memoryview]]

#: Queued behind a closed peer's last point-to-point messages: receiving it means "no more".
PEER_LEFT = Envelope(Kind.GOODBYE)


class CallTable:
    """See the module docstring."""

    def __init__(self, links: PeerLinks, config: CommConfig) -> None:
        self.links = links
        self.config = config
        self.mailbox: Mailbox[Item] = Mailbox()
        self.calls: dict[tuple[int, int], Call] = {}
        #: point-to-point receives in flight, and since when (perf_counter: flight records)
        self.receives: dict[Call, float] = {}
        self.next_cid = 1
        self.turns_taken = 0  # collective ids taken in every epoch (next_cid restarts)
        self.counters: Counter[str] = Counter()
        self.closed_after: dict[int, int] = {}  # peer rank -> its last collective id
        #: peers whose goodbye came over their link: no message of theirs follows it
        self.said_goodbye: set[int] = set()
        self.left_with_error: dict[int, str] = {}
        #: (epoch, cid, fingerprint) of the last call started and finished: heartbeats
        #: report them (described there, not on every call)
        self.started: tuple[int, int, Fingerprint] | None = None
        self.finished: tuple[int, int, Fingerprint] | None = None
        self._aborts: dict[int, Envelope] = {}  # aborts of calls not made here yet
        #: told when a peer said goodbye: (its rank, its last collective, calls failed)
        self._on_peer_left: Callable[[int, int, int], None] = lambda _rank, _last, _failed: None
        self._probing: set[tuple[int, int]] = set()  # calls whose timeout asks the peers
        #: calls that run long and asked the peers where they are (the progress log)
        self._asking: dict[tuple[int, int], WaitingFor] = {}
        #: the tables of sub-communicators (comm.split): a failure of this table's calls
        #: (a lost member, an eviction) fails theirs too
        self._children: list[CallTable] = []
        self.inbound: dict[Kind, Inbound] = {
            Kind.CHUNK: self.handle_chunk,
            Kind.CONFIRM: self.handle_chunk,
            Kind.ABORT: self.handle_abort,
            Kind.PROBE: self.handle_probe,
            Kind.PROGRESS: self.handle_progress,
            Kind.GOODBYE: self.handle_goodbye,
            Kind.PEER_MESSAGE: self.handle_peer_message,
        }

    def report_departures(self, to: Callable[[int, int, int], None]) -> None:
        """Tell `to(rank, last, failed)` (`ViewChanges.peer_left`) of each goodbye."""
        self._on_peer_left = to

    def adopt(self, child: CallTable) -> None:
        """Fail the calls of `child` (a sub-group's table) with this table's."""
        self._children.append(child)

    def disown(self, child: CallTable) -> None:
        if child in self._children:
            self._children.remove(child)

    @property
    def epoch(self) -> int:
        return self.links.epoch

    @property
    def rank(self) -> int:
        return self.links.rank

    @property
    def size(self) -> int:
        return self.links.size

    def enter(self, view: View) -> None:
        """A new view: ids start again at 1; what belonged to the old epoch is dropped.

        Calls of the previous epoch must be over (`ViewChanges` waits for them).
        """
        self.next_cid = 1
        self.closed_after.clear()
        self.said_goodbye.clear()
        self.left_with_error.clear()
        self._aborts.clear()
        self.counters["stale"] += self.mailbox.discard_where(
            lambda group: _epoch_of(group) < view.epoch
        )

    # -- the runner's side ------------------------------------------------------------------

    def take_cid(self) -> int:
        """The next collective id, in program order."""
        cid = self.next_cid
        self.next_cid += 1
        self.turns_taken += 1
        return cid

    def register(self, call: Call) -> None:
        """Make a new call known; an abort that arrived before it was made applies now."""
        self.calls[(call.epoch, call.cid)] = call
        self.started = (call.epoch, call.cid, call.fingerprint)
        abort = self._aborts.pop(call.cid, None)
        if abort is not None:
            call.fail(error_from_abort(abort, call.fingerprint, self.rank, late=True))

    def check_start(self, call: Call) -> CollectiveError | None:
        """Failures known before the call runs: a peer that left, an early mismatch."""
        for peer, last in self.closed_after.items():
            if last < call.cid:
                return self._goodbye_error(call, peer, last)
        for (peer, _lane), (env, _) in self.mailbox.first_items((call.epoch, call.cid)):
            error = self._mismatch(call, peer, env)
            if error is not None:
                return error
        return None

    def forget(self, cid: int) -> None:
        """Drop what arrived for a collective id this rank gave up before making a call."""
        self._aborts.pop(cid, None)
        self.counters["late"] += self.mailbox.discard((self.epoch, cid))

    def finish(self, call: Call) -> None:
        """Forget a call: later messages for it are dropped as late."""
        self.calls.pop((call.epoch, call.cid), None)
        self._asking.pop((call.epoch, call.cid), None)
        self.finished = (call.epoch, call.cid, call.fingerprint)
        self.counters["late"] += self.mailbox.discard((call.epoch, call.cid))

    def add_receive(self, receive: Call) -> None:
        self.receives[receive] = time.perf_counter()

    def end_receive(self, receive: Call) -> None:
        self.receives.pop(receive, None)

    def abort(self, call: Call, reason: str, message: str, ranks: Sequence[int] = ()) -> None:
        """Tell every peer that `call` failed here, so they fail it too instead of waiting."""
        body = abort_body(reason, message, self.rank, ranks)
        self.links.send_control(
            Envelope(
                Kind.ABORT, call.epoch, self.rank, call.cid, fingerprint=call.fingerprint, body=body
            )
        )

    def fail_all(self, make_error: Callable[[Call], BaseException], after: int = 0) -> int:
        """Fail every call in flight numbered above `after`, and every receive, here and in
        the sub-groups' tables; returns how many of this table's own failed (a sub-group's
        failed call is not one of this rank's program: its next call still owes the loss)."""
        failed = 0
        for call in [*self.calls.values(), *self.receives]:
            if (call.cid > after or call in self.receives) and call.failure is None:
                failed += call.fail(make_error(call))
        for child in self._children:
            child.fail_all(make_error)
        return failed

    def ask_where(self, call: Call, waiting: WaitingFor) -> None:
        """Ask the peers `waiting` has no answer from where they are, keeping the call
        (unlike `probe`); their answers go into `waiting` as they come."""
        self._asking[(call.epoch, call.cid)] = waiting
        ask = Envelope(
            Kind.PROBE,
            call.epoch,
            self.rank,
            call.cid,
            fingerprint=call.fingerprint,
            body={"keep": True},
        )
        self.links.send_control(ask, waiting.silent())

    async def probe(self, call: Call) -> dict[int, int | None]:
        """Ask every peer for its last started collective (None: no answer in time)."""
        peers = [p for p in range(self.size) if p != self.rank]
        probe = Envelope(Kind.PROBE, call.epoch, self.rank, call.cid, fingerprint=call.fingerprint)
        self.links.send_control(probe)
        progress: dict[int, int | None] = dict.fromkeys(peers)
        self._probing.add((call.epoch, call.cid))
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.probe_timeout):
                    for peer in peers:
                        env, _ = await self.mailbox.get(("progress", call.epoch, call.cid), peer)
                        progress[peer] = Fields(env.body, "Progress").get_int("started")
            # Answers that came while we waited for a peer before them (which did not
            # answer): without these, a live rank after a hung one was reported as silent.
            for peer, (env, _) in self.mailbox.first_items(("progress", call.epoch, call.cid)):
                if progress.get(peer) is None:
                    progress[peer] = Fields(env.body, "Progress").get_int("started")
            for peer in peers:  # a goodbye answers too: a peer that another prober made
                if progress[peer] is None and peer in self.closed_after:  # give up and leave
                    progress[peer] = self.closed_after[peer]  # is not where the hang is
        finally:
            self._probing.discard((call.epoch, call.cid))
            self.mailbox.discard(("progress", call.epoch, call.cid))
        return progress

    # -- errors -----------------------------------------------------------------------------

    def _mismatch(self, call: Call, peer: int, env: Envelope) -> CollectiveMismatchError | None:
        theirs = env.fingerprint
        if theirs is None:
            raise ProtocolError(f"rank {peer} sent a collective message without fingerprint")
        if not call.fingerprint.conflicts(theirs):
            return None
        message = mismatch_message(call.cid, self.rank, call.fingerprint, peer, theirs)
        self.abort(call, "mismatch", message, (self.rank, peer))
        return CollectiveMismatchError(
            message,
            ranks=(self.rank, peer),
            rank=self.rank,
            epoch=call.epoch,
            cid=call.cid,
            collective=call.fingerprint.collective,
        )

    def _goodbye_error(self, call: Call, peer: int, last: int) -> CollectiveError:
        error = self.left_with_error.get(peer)
        if error is not None:
            return CollectiveAbortedError(
                f"rank {peer} left the group after an error, before collective #{call.cid} "
                f"{call.fingerprint.describe()}: {error}",
                origin=peer,
                rank=self.rank,
                epoch=call.epoch,
                cid=call.cid,
                collective=call.fingerprint.collective,
            )
        return MemberLeftError(
            goodbye_message(call.cid, call.fingerprint, self.rank, peer, last),
            left=(peer,),
            rank=self.rank,
            epoch=call.epoch,
            cid=call.cid,
            collective=call.fingerprint.collective,
        )

    def peer_left_error(self, peer: int, what: str) -> CollectiveError:
        """The error of a send to, or receive from, a peer that closed its communicator:
        `MemberLeftError` for a graceful leave, as collectives give (a membership change
        that `dsml.elastic` recovers from), `CollectiveAbortedError` carrying the error
        it left by."""
        error = self.left_with_error.get(peer)
        message = f"{what} rank {peer} cannot complete: rank {peer} closed its communicator"
        where = {"rank": self.rank, "epoch": self.epoch, "collective": what.split()[0]}
        if error is None:
            return MemberLeftError(message, left=[peer], **where)
        return CollectiveAbortedError(
            f"{message} after an error: {error}",
            origin=peer,
            **where,
        )

    # -- inbound (from PeerLinks: sender already checked to be a peer of this epoch) ---------

    def _open_call(self, env: Envelope) -> Call | None:
        """The call a message belongs to; None if it is for a call not made yet."""
        call = self.calls.get((env.epoch, env.cid))
        if call is None and env.cid >= self.next_cid + _MAX_AHEAD:
            raise ProtocolError(f"collective #{env.cid} is implausibly far ahead")
        return call

    def handle_chunk(self, rank: int, env: Envelope, payload: list[memoryview]) -> None:
        call = self._open_call(env)
        if call is None and env.cid < self.next_cid:
            self.counters["late"] += 1  # the call already finished (or failed) here
            return
        if call is not None:
            error = self._mismatch(call, rank, env)
            if error is not None:
                call.fail(error)
                return
        self.mailbox.put((env.epoch, env.cid), (rank, _LANES[env.kind]), (env, payload))

    def handle_abort(self, rank: int, env: Envelope, payload: list[memoryview]) -> None:
        call = self._open_call(env)
        if call is not None:
            call.fail(error_from_abort(env, call.fingerprint, self.rank))
        elif env.cid >= self.next_cid:
            Fields(env.body, "Abort").get_str("message", 8192)  # validate before keeping
            self._aborts[env.cid] = env
        else:
            self.counters["late"] += 1

    def handle_probe(self, rank: int, env: Envelope, payload: list[memoryview]) -> None:
        """Answer where this rank is; unless the prober keeps waiting (the progress log
        asks with `keep`), give the call up too: the prober is about to abort it.

        Failing here, not only on the prober's abort, means a rank that arrives late cannot
        finish from data its peers had already sent while they report a timeout.
        """
        fields = Fields(env.body, "Probe")
        keep = fields.has("keep") and fields.get_bool("keep")
        self.links.send_control(self._where_am_i(env.cid), [rank])
        if keep:
            return
        message = (
            f"rank {rank} timed out in collective #{env.cid} {GAVE_UP} "
            "(its own error says which ranks it was waiting for)"
        )
        given_up = Envelope(
            Kind.ABORT,
            env.epoch,
            rank,
            env.cid,
            fingerprint=env.fingerprint,
            body=abort_body("timeout", message, rank),
        )
        self.handle_abort(rank, given_up, [])

    def _where_am_i(self, cid: int) -> Envelope:
        """A `Progress` answer to a probe of `cid`: this rank's last started collective
        id, and its kind when that call was made here (not a turn skipped)."""
        body: dict[str, Any] = {"started": self.next_cid - 1}
        started = self.started
        if started is not None and started[:2] == (self.epoch, self.next_cid - 1):
            body["kind"] = started[2].collective
        return Envelope(Kind.PROGRESS, self.epoch, self.rank, cid, body=body)

    def handle_progress(self, rank: int, env: Envelope, payload: list[memoryview]) -> None:
        fields = Fields(env.body, "Progress")
        started = fields.get_int("started")
        kind = fields.get_str("kind", 64, optional=True)
        key = (env.epoch, env.cid)
        if key in self._probing:
            self.mailbox.put(("progress", env.epoch, env.cid), rank, (env, payload))
        elif key in self._asking:
            self._asking[key].answer(rank, started, kind)
        else:
            self.counters["late"] += 1  # the probe already gave up waiting for it

    def handle_goodbye(self, rank: int, env: Envelope, payload: list[memoryview]) -> None:
        fields = Fields(env.body, "Goodbye")
        last = fields.get_int("last")
        error = fields.get_str("error", 2048, optional=True)
        failed = self.peer_closed(rank, last, error)
        self.peer_messages_ended(rank)
        self._on_peer_left(rank, last, failed)

    def handle_peer_message(self, rank: int, env: Envelope, payload: list[memoryview]) -> None:
        if env.fingerprint is None:
            raise ProtocolError("a point-to-point message needs a fingerprint")
        self.mailbox.put(("p2p", env.epoch), (rank, env.step), (env, payload))

    def peer_closed(self, rank: int, last: int, error: str | None = None) -> int:
        """Rank `rank` closed after collective `last`: fail this epoch's later calls.

        Its point-to-point receives are left to `peer_messages_ended`: this may be the
        registry's word, which can come before the messages rank sent on its link.
        Returns how many calls in flight failed.
        """
        self.closed_after.setdefault(rank, last)
        if error is not None:
            self.left_with_error.setdefault(rank, error)
        failed = 0
        for call in list(self.calls.values()):
            if call.cid > last and call.failure is None:
                failed += call.fail(self._goodbye_error(call, rank, last))
        return failed

    def peer_messages_ended(self, rank: int) -> None:
        """Nothing more comes from `rank` (its goodbye arrived, behind its messages):
        receives from it fail once they have taken what it sent."""
        if rank in self.said_goodbye:
            return
        self.said_goodbye.add(rank)
        for tag in {r.tag for r in self.receives if r.peer == rank}:
            # A marker behind the messages already queued: they are still delivered.
            self.mailbox.put(("p2p", self.epoch), (rank, tag), (PEER_LEFT, []))

    def __repr__(self) -> str:
        return (
            f"<CallTable epoch={self.epoch} next_cid={self.next_cid} calls={len(self.calls)} "
            f"receives={len(self.receives)} mailbox={len(self.mailbox)} {dict(self.counters)}>"
        )


def _epoch_of(group: Any) -> int:
    """The epoch of a mailbox group key: (epoch, cid), ("p2p", epoch), ("progress", e, c)."""
    if isinstance(group, tuple) and group:
        first = group[0]
        if isinstance(first, int):
            return first
        if len(group) > 1 and isinstance(group[1], int):
            return group[1]
    return 0
