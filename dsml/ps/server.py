"""A parameter server's serving loop (parameter-server layer).

Per view, two tasks per active worker: one receives its requests in order and hands
them to the `ShardState`, one sends it the replies that became ready (a BSP reply to
one worker is often made ready by another worker's push). A change of view (a worker
lost) fails every pending point-to-point call of the old view: the tasks of that view
end, the lost workers are dropped from the state, the replies it owed are forgotten (the
workers send their requests again, under their old numbers) and a new set of tasks
serves the new view. A worker that closed without `DONE` is dropped the same way.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import numpy as np

from ..communicator import Communicator
from ..errors import CollectiveAbortedError, MemberLeftError, MembershipChangedError, ProtocolError
from .layout import Layout
from .messages import DONE, decode_request, encode_error, encode_reply
from .push_codec import PushCodec
from .roles import Roles, retry_pause, wait_next_view
from .shard_state import Outgoing, ShardState

__all__ = ["REPLY_TAG", "REQUEST_TAG", "Server"]

log = logging.getLogger("dsml.ps")

REQUEST_TAG = 0x5053_0001  # worker -> server
REPLY_TAG = 0x5053_0002  # server -> worker


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
    ) -> None:
        self._comm, self._roles, self.index = comm, roles, index
        self._codec = codec
        self._layout, self.state, self._timeout_s = layout, state, timeout_s
        self._answered: set[int] = set()  # workers whose DONE reply was sent
        self._lost: set[int] = set()
        self._outboxes: dict[int, asyncio.Queue[_Send | None]] = {}

    def _active(self) -> list[int]:
        return [w for w in range(len(self._roles.workers)) if w not in self._answered | self._lost]

    async def serve(self) -> None:
        """Answer the workers until every one has finished (`DONE`) or was lost."""
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
        self.state.forget_waiting()
        view = self._comm.view
        for w in self._active():
            if view.rank_of(self._roles.workers[w]) is None:
                log.warning(
                    "parameter server %d: worker %d was lost; going on without it", self.index, w
                )
                self._drop(w)

    def _drop(self, worker: int) -> None:
        self._lost.add(worker)
        self._dispatch(self.state.drop(worker))
        outbox = self._outboxes.get(worker)
        if outbox is not None:
            outbox.put_nowait(None)  # its sender stops

    async def _serve_view(self) -> None:
        active = self._active()
        self._outboxes = {w: asyncio.Queue() for w in active}
        async with asyncio.TaskGroup() as tasks:
            for worker in active:
                tasks.create_task(self._receive_from(worker))
                tasks.create_task(self._send_to(worker))

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
                    self._rank(worker), tag=REQUEST_TAG, timeout=self._timeout_s
                )
            except (MemberLeftError, CollectiveAbortedError) as exc:
                log.warning("parameter server %d: worker %d left (%s)", self.index, worker, exc)
                self._drop(worker)
                return
            try:
                request = decode_request(buf, self._layout, self.index, self._codec)
                self._dispatch(self.state.handle(worker, request))
            except ProtocolError as exc:
                log.error(
                    "parameter server %d: worker %d sent a bad request: %s", self.index, worker, exc
                )
                self._outboxes[worker].put_nowait(_Send(encode_error(0, str(exc)), final=True))
                self._lost.add(worker)
                self._dispatch(self.state.drop(worker))
                return
            if request.kind == DONE:
                return

    async def _send_to(self, worker: int) -> None:
        outbox = self._outboxes[worker]
        while (item := await outbox.get()) is not None:
            await self._comm.send(
                item.buf, self._rank(worker), tag=REPLY_TAG, timeout=self._timeout_s
            )
            if item.final:
                self._answered.add(worker)
                return

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
