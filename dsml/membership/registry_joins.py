"""Joining and leaving, as the registry handles them (membership layer).

`RegistryJoins` forms the first group (ranks in join order, or the rank a member asked
for, as `dsml run` does), admits joiners to a running group at a boundary the members
agree on (the registry's PROPOSE, the members' READY with their next collective id: the
largest is the boundary), and ends the epoch of a member that leaves.
"""

from __future__ import annotations

import logging
from typing import Any

from ..errors import ConfigError, ProtocolError
from ..transport import check_address
from ..wire import Envelope, Fields, Kind
from .registry_core import RegistryCore, _Joiner, _Proposal
from .view import Change, Member

__all__ = ["RegistryJoins"]

log = logging.getLogger("dsml.registry")

_MAX_WORLD = 1 << 16


class RegistryJoins(RegistryCore):
    """The registry's handlers of joins and leaves; see the module docstring."""

    def handle_join_request(self, sender: bytes, env: Envelope) -> None:
        fields = Fields(env.body, "JoinRequest")
        member = Member.from_wire(fields.get_map("member"))
        world_size = fields.get_int("world_size", 1, _MAX_WORLD)
        wanted = fields.get_int("rank", 0, _MAX_WORLD, optional=True)
        # absent (an older member): join whatever runs, as those did
        running = fields.get_bool("running") if fields.has("running") else True
        if sender != member.id.encode():
            raise ProtocolError("JoinRequest identity does not match its member id")
        if self._view is not None and self._view.rank_of(member.id) is not None:
            self._send_view(member.id, self._view, Change(previous=self._view.epoch))  # a retry
            return
        if member.id in self._evicted:
            self._reply(sender, Kind.JOIN_REJECTED, {"reason": "this member id was evicted"})
            return
        joins_running = self._joins_running(member.id, world_size, running)
        reason = self._join_refusal(member, world_size, wanted, forming=not joins_running)
        if reason:
            log.warning("refused %s: %s", member.describe(), reason)
            self._refused.append(f"{member.describe()}: {reason}")
            self._reply(sender, Kind.JOIN_REJECTED, {"reason": reason})
            return
        accepted = self._settings()
        if joins_running:
            assert self._view is not None
            self._joining.pop(member.id, None)
            self._pending[member.id] = member
            accepted |= {"joined": len(self._pending), "world_size": self._view.size}
            self._reply(sender, Kind.JOIN_ACCEPTED, accepted | {"running": True})
            self._schedule_proposal()
            return
        self._joining[member.id] = _Joiner(member, world_size, wanted)
        accepted |= {"joined": len(self._joining), "world_size": world_size}
        if self._view is not None:  # it waits for the running group to end: say so
            accepted |= self._running_group(member)
        self._reply(sender, Kind.JOIN_ACCEPTED, accepted | {"running": False})
        if self._view is None and len(self._joining) == world_size:
            self._form_group(world_size)

    def _joins_running(self, member_id: str, world_size: int, running: bool) -> bool:
        """Does this join go into the running group (at its next boundary)? Yes for a
        member that asked to join whatever runs, or whose world_size the group lacks (it
        replaces a member lost, or grows the group). A member whose world_size the group
        already has waits in `_joining` for the group to end and forms the next one: it
        is a second job pointed here, or a re-run whose dead predecessors the registry
        has not yet dropped. Merged into the running group, its data went into that
        group's sums. Members that left by closing still count as had: a group whose
        members close one after another is ending, and a worker waiting for it to end
        was admitted into it as they did (then lost its last peers at its first call)."""
        if self._view is None:
            return False
        have = self._view.size + len([m for m in self._pending if m != member_id])
        return running or world_size > have + self._left_seats

    def _running_group(self, member: Member) -> dict[str, Any]:
        """What a joiner that waits for the next group is told of the running one: its
        size, epoch, and the ranks that run in the joiner's own process (a notebook that
        calls `init` again without closing the communicator it made before)."""
        assert self._view is not None
        mine = [
            rank
            for rank, m in enumerate(self._view.members)
            if m.pid == member.pid and m.host == member.host and member.pid > 0
        ]
        return {"waits_for": {"size": self._view.size, "epoch": self._view.epoch, "mine": mine}}

    def _admit_waiting(self) -> None:
        """After a change of view: waiting joiners whose world_size the running group now
        lacks join it; once no group runs, those waiting form the next one."""
        if self._view is None:
            sizes = {j.world_size for j in self._joining.values()}
            if len(sizes) == 1 and len(self._joining) == next(iter(sizes)):
                self._form_group(next(iter(sizes)))
            return
        for member_id, joiner in list(self._joining.items()):
            if self._joins_running(member_id, joiner.world_size, running=False):
                del self._joining[member_id]
                self._pending[member_id] = joiner.member
        if self._pending:
            self._schedule_proposal()

    def _join_refusal(
        self, member: Member, world_size: int, wanted: int | None, *, forming: bool
    ) -> str:
        """Why a member is refused, or "": its address; and where it would form (or wait
        to form) a group, its world_size and rank against the others'."""
        try:
            check_address(member.address, "member address")
        except ConfigError as exc:
            return str(exc)
        if not forming:
            return ""  # joins the running group: its rank is the group's business
        others = [j for j in self._joining.values() if j.member.id != member.id]
        if others and others[0].world_size != world_size:
            return (
                f"this registry is forming a group of world_size={others[0].world_size}, "
                f"but this member asked for world_size={world_size}"
            )
        if wanted is not None and wanted >= world_size:
            return f"rank {wanted} is out of range for world_size={world_size}"
        if wanted is not None and any(j.wanted_rank == wanted for j in others):
            return f"rank {wanted} was already taken by another member"
        return ""

    def _form_group(self, world_size: int) -> None:
        joiners = list(self._joining.values())
        ranks: list[Member | None] = [None] * world_size
        for joiner in joiners:
            if joiner.wanted_rank is not None:
                ranks[joiner.wanted_rank] = joiner.member
        free = iter(j.member for j in joiners if j.wanted_rank is None)
        members = tuple(m if m is not None else next(free) for m in ranks)
        self._joining.clear()
        self._refused.clear()  # refusals since the last group formed: what the next waits on
        log.info("forming a group of %d", world_size)
        self._publish(members, Change(joined=tuple(m.id for m in members)))

    def handle_ready(self, sender: bytes, env: Envelope) -> None:
        fields = Fields(env.body, "Ready")
        epoch = fields.get_int("epoch", 1)
        next_cid = fields.get_int("next_cid", 1)
        proposal = self._proposal
        if proposal is None or epoch != proposal.view.epoch or self._view is None:
            return  # an answer to a proposal a failure replaced
        member_id = self._member_of(sender)
        if self._view.rank_of(member_id) is None:
            return
        proposal.ready[member_id] = next_cid
        if len(proposal.ready) == self._view.size:
            self._commit(proposal)

    def _commit(self, proposal: _Proposal) -> None:
        self._proposal = None
        joined = [m for m in proposal.joined if m in self._pending]
        for member_id in joined:
            del self._pending[member_id]
        boundary = max(proposal.ready.values())
        assert self._view is not None
        newcomers = tuple(m for m in proposal.view.members if m.id in joined)
        change = Change(previous=self._epoch, boundary=boundary, joined=tuple(joined))
        self._publish(self._view.members + newcomers, change)
        if self._pending:
            self._schedule_proposal()

    # -- leaving ----------------------------------------------------------------------------

    def handle_leave_request(self, sender: bytes, env: Envelope) -> None:
        member_id = self._member_of(sender)
        fields = Fields(env.body, "LeaveRequest")
        last = fields.get_int("last", 0, optional=True) or 0
        # `last` counts in the numbering of the view the member last entered (`epoch`,
        # absent from older members): relayed with it, so that a peer that entered a newer
        # view, which the member never did, does not wait for it in its own calls 1..last.
        epoch = fields.get_int("epoch", 0, optional=True) or 0
        if self._joining.pop(member_id, None) is not None:
            return
        if self._pending.pop(member_id, None) is not None:
            return
        if self._view is None or self._view.rank_of(member_id) is None:
            return
        epochs = {member_id: epoch} if epoch else {}
        self._remove([], [(member_id, last)], f"member {member_id} left", left_epochs=epochs)
