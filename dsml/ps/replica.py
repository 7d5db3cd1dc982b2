"""A backup copy of another server's shard, and taking over when that server is lost
(parameter-server layer).

Primary-backup replication: with `PSConfig(replicas=1)` and at least two servers, server
s + 1 (mod S) holds a copy of server s's shard. The primary forwards every request it
takes to the backup before applying it, and applies it only once the backup has
acknowledged (see `dsml.ps.server`), so the backup's `ShardState` has applied the same
requests in the same order, and at most one more. Replies are the primary's alone.

When the primary is lost, the backup becomes the shard's server: it answers the pulls it
holds that can be answered (a worker ignores an answer it no longer waits for), and
serves the workers on the shard's own tags, which they now
send to (`dsml.ps.client` looks the shard's holder up in each view). Requests the primary
had not answered are sent again under their old numbers, so each is applied exactly once
(a request the backup had already applied is only answered). A worker whose `DONE` the
primary had answered does not send again; the new server counts it out once it leaves
the group. Losing a primary and its backup together loses the shard: `ServerLostError`.
"""

from __future__ import annotations

import logging

import numpy as np

from ..communicator import Communicator
from ..errors import CollectiveAbortedError, MemberLeftError, MembershipChangedError, ProtocolError
from .layout import Layout
from .messages import decode_request
from .push_codec import PushCodec
from .roles import Roles, retry_pause, wait_next_view
from .server import STOP, Server, tags_of
from .shard_state import ShardState

__all__ = ["Replica"]

log = logging.getLogger("dsml.ps")


class Replica:
    """This server rank's copy of shard `shard` (whose primary is server `shard`)."""

    def __init__(
        self,
        comm: Communicator,
        roles: Roles,
        shard: int,
        layout: Layout,
        state: ShardState,
        timeout_s: float,
        codec: PushCodec | None = None,
    ) -> None:
        self._comm, self._roles, self.shard = comm, roles, shard
        self._layout, self.state, self._timeout_s = layout, state, timeout_s
        self._codec = codec
        self._tags = tags_of(shard)
        self.took_over = False
        self.server: Server | None = None

    def _primary_rank(self) -> int | None:
        return self._comm.view.rank_of(self._roles.servers[self.shard])

    async def serve(self) -> None:
        """Follow the primary until it retires; if it is lost first, serve the shard."""
        if await self._follow():
            return
        log.warning("parameter server %d was lost: its backup takes over its shard", self.shard)
        self.took_over = True
        self.server = Server(
            self._comm,
            self._roles,
            self.shard,
            self._layout,
            self.state,
            self._timeout_s,
            self._codec,
        )
        self.server.answer_ready()  # pulls the primary may not have answered
        await self.server.serve()

    async def _follow(self) -> bool:
        """Apply the primary's forwarded requests; True once it retired, False once lost."""
        attempt = 0
        while (rank := self._primary_rank()) is not None:
            try:
                buf = await self._comm.recv(rank, tag=self._tags.forward, timeout=self._timeout_s)
                if not self._apply(buf):
                    return True
                await self._comm.send(np.zeros(1, np.uint8), rank, tag=self._tags.ack)
            except (MemberLeftError, CollectiveAbortedError):
                return False
            except MembershipChangedError as exc:  # the primary sends again what it must
                await wait_next_view(self._comm, exc, self._timeout_s)
                await retry_pause(attempt)
                attempt += 1
        return False

    def _apply(self, buf: np.ndarray) -> bool:
        """Apply one forwarded request or drop; False for the primary's retirement."""
        if buf.nbytes < 8:
            raise ProtocolError("a forwarded parameter-server message is too short")
        word, workers = int(buf[:8].view(np.int64)[0]), len(self._roles.workers)
        if word == STOP:
            return False
        if 0 <= -2 - word < workers:
            self.state.drop(-2 - word)
        elif 0 <= word < workers:
            request = decode_request(buf[8:], self._layout, self.shard, self._codec)
            self.state.handle(word, request)  # the replies are the primary's to send
        else:
            raise ProtocolError(f"a forwarded parameter-server message names worker {word}")
        return True

    def __repr__(self) -> str:
        role = "serving" if self.took_over else "following"
        return f"<ps.Replica of shard {self.shard}, {role}, {self.state!r}>"
