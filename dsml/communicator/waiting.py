"""Which peers a call in flight still waits for, and where each was seen (communicator).

A `WaitingFor` is made when a call has run long: by the progress log (progress.py), which
asks the peers where they are without giving the call up, and by the timeout, whose probe
asks the same before the call fails. It holds each peer's answer, its last started
collective (and that call's kind when the peer said), and sorts the peers into those that
have arrived, those behind (not yet at this call) and those silent (no answer yet). Every
peer is asked: a rank knows locally only whom it is receiving from, and a ring's left
neighbour may itself be waiting for the late rank further on.

The warning of the progress log and the message of `CollectiveTimeoutError` are both
written from it (diagnose.py), and the call's `CallRecord` keeps the last one, so the
recent calls of `comm.stats()` (and a flight recorder reading them) can say whom a call
waited for.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping

__all__ = ["WaitingFor"]


class WaitingFor:
    """The peers of collective `cid` and where each was last seen (see the module doc).

    `started[r]` is rank r's last started collective id: at least `cid` means r has
    arrived, None means r has not answered (yet). `answered` is resolved once every peer
    asked has answered.
    """

    __slots__ = ("answered", "asked_at", "cid", "kinds", "started")

    def __init__(self, cid: int, asked: Iterable[int]) -> None:
        self.cid = cid
        self.asked_at = time.perf_counter()
        self.started: dict[int, int | None] = dict.fromkeys(asked)
        self.kinds: dict[int, str] = {}  # rank -> kind of its last started call, if said
        self.answered: asyncio.Future[None] | None = None

    @classmethod
    def from_answers(cls, cid: int, answers: Mapping[int, int | None]) -> WaitingFor:
        """The record of a probe that has its answers already (the timeout's)."""
        waiting = cls(cid, answers)
        waiting.started.update(answers)
        return waiting

    def answer(self, rank: int, started: int, kind: str | None = None) -> None:
        """Rank `rank` said its last started collective is `started` (of kind `kind`)."""
        if rank not in self.started:
            return  # not asked (a reply to an earlier question)
        self.started[rank] = started
        if kind is not None:
            self.kinds[rank] = kind
        if self.answered is not None and not self.answered.done() and not self.silent():
            self.answered.set_result(None)

    def behind(self) -> dict[int, int]:
        """The peers that answered and have not reached this call: rank -> last started."""
        return {r: last for r, last in self.started.items() if last is not None and last < self.cid}

    def silent(self) -> list[int]:
        """The peers that have not answered (yet)."""
        return [r for r, last in self.started.items() if last is None]

    def missing(self) -> list[int]:
        """Every peer the call may still wait for (behind or silent), in rank order."""
        return sorted([*self.behind(), *self.silent()])

    def last_seen(self, rank: int) -> str:
        """Where `rank` was seen: `collective #3 all_reduce`, or `collective #0`."""
        kind = self.kinds.get(rank)
        return f"collective #{self.started[rank]}" + (f" {kind}" if kind else "")

    def __repr__(self) -> str:
        return f"<WaitingFor #{self.cid} missing={self.missing()} started={self.started}>"
