"""A parameter server's serving loop (parameter-server layer).

Per view, two tasks per active worker: one receives its requests in order and queues
them, one sends it the replies that became ready (a BSP reply to one worker is often made
ready by another worker's push); one applier task takes the queued requests in order,
forwards each to the shard's backup when there is one (and waits for its
acknowledgement: the backup has applied it), then hands it to the `ShardState`. So the
backup has applied every request the primary has, in the same order, and at most one
more; a worker that re-sends a request to the backup after the primary is lost has it
applied once (see `dsml.ps.replica`).

A change of view (a worker lost) fails every pending point-to-point call of the old view:
the tasks of that view end, the lost workers are dropped from the state, and a new set of
tasks serves the new view. Nothing received is forgotten in between: requests not yet
applied, pulls waiting and replies not yet sent carry over, because a worker may have
sent its request in the new view already and will not send it again. A worker that did
see the change sends its request again under its old number: it is applied once and
answered twice, and the worker ignores the answer it no longer waits for. A worker that
closed without `DONE` is dropped the same way as a lost one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..communicator import Communicator
from ..errors import CollectiveAbortedError, MemberLeftError, MembershipChangedError, ProtocolError
from .layout import Layout
from .messages import DONE, Request, decode_request, encode_error, encode_reply
from .push_codec import PushCodec
from .roles import Roles, retry_pause, wait_next_view
from .shard_state import Outgoing, ShardState

__all__ = ["Server", "Tags", "tags_of"]

log = logging.getLogger("dsml.ps")

_TAG_BASE = 0x5053_0000  # "PS"; each shard has its own streams, 16 tags apart


@dataclass(frozen=True)
class Tags:
    """The point-to-point tags of one shard's streams."""

    request: int  # worker -> the shard's server (primary, or the backup once it took over)
    reply: int  # server -> worker
    forward: int  # primary -> backup: a request, prefixed by the worker's index
    ack: int  # backup -> primary: that request is applied


def tags_of(shard: int) -> Tags:
    base = _TAG_BASE + 16 * shard
    return Tags(base + 1, base + 2, base + 3, base + 4)


@dataclass(frozen=True)
class _Taken:
    """What the applier does next, in order: a worker's request, or dropping a worker
    (`request` None), or stopping (`worker` -1)."""

    worker: int
    request: Request | None = None
    buf: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))


STOP = -1  # the forwarded word that retires the backup; -2 - w drops worker w


@dataclass(frozen=True)
class _Send:
    buf: np.ndarray
    final: bool


class Server:
    """Serves this rank's shard to the workers until each is done or lost."""

    def __init__(
        self,
        comm: Communicator,
        roles: Roles,
        index: int,
        layout: Layout,
        state: ShardState,
        timeout_s: float,
        codec: PushCodec | None = None,
        backup: str | None = None,
    ) -> None:
        self._comm, self._roles, self.index = comm, roles, index
        self._codec, self._backup = codec, backup  # backup: the member id holding a replica
        self._tags = tags_of(index)
        self._taken: deque[_Taken] = deque()  # received, to apply in order
        self._taken_added = asyncio.Event()
        self._layout, self.state, self._timeout_s = layout, state, timeout_s
        self._answered: set[int] = set()  # workers whose DONE reply was sent
        self._lost: set[int] = set()
        workers = range(len(roles.workers))
        self._outboxes: dict[int, asyncio.Queue[_Send | None]] = {
            w: asyncio.Queue() for w in workers
        }
        self._unsent: dict[int, _Send] = {}  # a reply whose send a change of view cut short

    def _active(self) -> list[int]:
        return [w for w in range(len(self._roles.workers)) if w not in self._answered | self._lost]

    async def serve(self) -> None:
        """Answer the workers until every one has finished (`DONE`) or was lost; then
        tell the backup, if any, that this shard is done."""
        await self._serve_until_done()
        await self._drain()
        await self._retire_backup()

    async def _serve_until_done(self) -> None:
        attempt = 0
        while self._active():
            try:
                await self._serve_view()
                attempt = 0
            except* MembershipChangedError as group:
                failure = group.exceptions[0]
                assert isinstance(failure, MembershipChangedError)
                await wait_next_view(self._comm, failure, self._timeout_s)
                await retry_pause(attempt)
                attempt += 1
                self._after_view_change()

    def _after_view_change(self) -> None:
        """Nothing taken is forgotten: the requests received and not applied yet, the
        pulls waiting and the replies not sent all carry over to the next view (a
        request may have been sent in the new view already, so its worker would not send
        it again; one that does is applied once and answered twice, and the worker
        ignores the older answer)."""
        self._taken = deque(t for t in self._taken if t.worker != STOP)

    def _drop_absent(self) -> None:
        """Drop the workers the view no longer has, before any task of the view starts:
        a task failing on one of them would cancel the others, and a receive cancelled
        just after it took a message loses that message."""
        view = self._comm.view
        for w in self._active():
            if view.rank_of(self._roles.workers[w]) is None:
                log.warning(
                    "parameter server %d: worker %d was lost; going on without it", self.index, w
                )
                self._drop(w)

    def _take(self, taken: _Taken) -> None:
        self._taken.append(taken)
        self._taken_added.set()

    def _drop(self, worker: int) -> None:
        self._lost.add(worker)
        self._take(_Taken(worker))  # applied (and forwarded) in order
        self._outboxes[worker].put_nowait(None)  # its sender stops

    async def _serve_view(self) -> None:
        """Serve the active workers in this view; ends once each is answered or lost."""
        self._drop_absent()
        active = self._active()
        async with asyncio.TaskGroup() as tasks:
            applier = tasks.create_task(self._apply_taken())
            receivers = [tasks.create_task(self._receive_from(w)) for w in active]
            await asyncio.gather(*(tasks.create_task(self._send_to(w)) for w in active))
            for receiver in receivers:  # a worker whose DONE is answered sends no more
                receiver.cancel()
            self._take(_Taken(STOP))
            await applier  # apply what is still queued, then stop

    def _rank(self, worker: int) -> int:
        rank = self._comm.view.rank_of(self._roles.workers[worker])
        if rank is None:  # lost in a view newer than the one this round serves
            epoch = self._comm.view.epoch - 1
            raise MembershipChangedError(f"worker {worker} is not in the view", epoch=epoch)
        return rank

    async def _receive_from(self, worker: int) -> None:
        while True:
            try:
                buf = await self._comm.recv(
                    self._rank(worker), tag=self._tags.request, timeout=self._timeout_s
                )
            except (MemberLeftError, CollectiveAbortedError) as exc:
                log.warning("parameter server %d: worker %d left (%s)", self.index, worker, exc)
                self._drop(worker)
                return
            try:
                request = decode_request(buf, self._layout, self.index, self._codec)
            except ProtocolError as exc:
                self._refuse(worker, exc)
                return
            self._take(_Taken(worker, request, buf))
            if request.kind == DONE:
                return

    def _refuse(self, worker: int, exc: ProtocolError) -> None:
        log.error("parameter server %d: worker %d sent a bad request: %s", self.index, worker, exc)
        self._outboxes[worker].put_nowait(_Send(encode_error(0, str(exc)), final=True))
        self._lost.add(worker)
        self._take(_Taken(worker))

    async def _apply_taken(self) -> None:
        """Apply the queued requests and drops in order, each after the backup has; an
        item leaves the queue only once applied, so one cut short by a change of view is
        applied in the next (the backup ignores a request it already has)."""
        while True:
            while not self._taken:
                self._taken_added.clear()
                await self._taken_added.wait()
            if self._taken[0].worker == STOP:
                self._taken.popleft()
                return
            await self._apply(self._taken[0])
            self._taken.popleft()

    async def _apply(self, taken: _Taken) -> None:
        if taken.request is None:
            await self._forward(-2 - taken.worker, taken.buf)
            self._dispatch(self.state.drop(taken.worker))
            return
        if taken.worker in self._lost:
            return
        await self._forward(taken.worker, taken.buf)
        try:
            self._dispatch(self.state.handle(taken.worker, taken.request))
        except ProtocolError as exc:
            self._refuse(taken.worker, exc)

    async def _drain(self) -> None:
        """After the last view: apply the drops still queued (the backup follows if it
        can; nobody is left to be answered)."""
        while self._taken:
            taken = self._taken.popleft()
            if taken.worker == STOP:
                continue
            try:
                await self._apply(taken)
            except MembershipChangedError:
                self._backup = None  # lost meanwhile: nobody will take this shard over
                await self._apply(taken)

    def _backup_rank(self) -> int | None:
        return None if self._backup is None else self._comm.view.rank_of(self._backup)

    async def _forward(self, word: int, buf: np.ndarray) -> None:
        """Send the backup one word (a worker's index: its request follows; -2 - w: drop
        worker w; STOP) and what follows, then wait until it has applied them."""
        rank = self._backup_rank()
        if rank is None:
            return  # no replica (or it was lost): this shard goes on alone
        head = np.array([word], np.int64).view(np.uint8)
        message = np.concatenate([head, buf])
        await self._comm.send(message, rank, tag=self._tags.forward, timeout=self._timeout_s)
        await self._comm.recv(rank, tag=self._tags.ack, timeout=self._timeout_s)

    async def _retire_backup(self) -> None:
        """Every worker is answered: the backup may stop."""
        rank = self._backup_rank()
        if rank is None:
            return
        try:
            retire = np.array([STOP], np.int64).view(np.uint8)
            await self._comm.send(retire, rank, tag=self._tags.forward, timeout=self._timeout_s)
        except MembershipChangedError:
            pass  # the backup was lost meanwhile: nobody is waiting for this

    async def _send_to(self, worker: int) -> None:
        """Send the worker its replies in order; one whose send a change of view cut
        short goes first in the next view."""
        outbox = self._outboxes[worker]
        while (item := self._unsent.pop(worker, None) or await outbox.get()) is not None:
            try:
                await self._comm.send(
                    item.buf, self._rank(worker), tag=self._tags.reply, timeout=self._timeout_s
                )
            except BaseException:
                self._unsent[worker] = item
                raise
            if item.final:
                self._answered.add(worker)
                return

    def answer_ready(self) -> None:
        """Queue the replies to every waiting pull that can be answered now."""
        self._dispatch(self.state.ready())

    def _dispatch(self, outgoing: list[Outgoing]) -> None:
        for out in outgoing:
            outbox = self._outboxes.get(out.worker)
            if outbox is not None and out.worker not in self._lost:
                outbox.put_nowait(_Send(encode_reply(out.seq, out.values), out.final))

    def __repr__(self) -> str:
        return (
            f"<ps.Server {self.index} answered={sorted(self._answered)} "
            f"lost={sorted(self._lost)} {self.state!r}>"
        )
