"""torch's receive from any source and monitored barrier, over dsml's send/recv (adapter layer).

dsml's `recv` takes a source rank: messages are ordered per (source, destination, tag).
`Receives.recv_any` receives from whichever rank sends first by starting one receive per
other rank and cancelling the rest once one has a message. A cancelled receive that had
no message yet leaves its stream as it was (the mailbox puts back what it handed over);
one that had already completed took a message that nobody asked for: it is kept here, per
(tag, source), and given to the next receive of that tag from that source, in order. So
that no later receive overtakes a kept message, each receive of a tag first waits until
the any-source receives of that tag started before it have settled. Runs on the
communicator's loop thread; receives start there in call order.

`send`, `recv` and `recv_anysource` are the `Run`s of torch's point-to-point calls that
`ProcessGroupDsml` (process_group.py) starts there.

`monitored_barrier` is gloo's: every rank but 0 sends to rank 0 and waits for its answer;
rank 0 waits for each rank (all of them with `wait_all_ranks`) within the timeout and
names those that did not arrive, with gloo's messages.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque
from typing import Any

import numpy as np

from ..communicator import Communicator
from ..errors import DsmlError
from .mapping import Run, Tensors, _all, _copy_into
from .work import RunState

__all__ = [
    "MONITORED_BARRIER_TAG",
    "Receives",
    "monitored_barrier",
    "recv",
    "recv_anysource",
    "send",
]

#: the tag of monitored_barrier's messages (torch users' tags are small numbers)
MONITORED_BARRIER_TAG = (1 << 31) - 1

Array = Any


class Receives:
    """The receives of one process group: per source, or from any source."""

    def __init__(self) -> None:
        # messages that a cancelled receive of recv_any had taken, per tag and source
        self._kept: defaultdict[int, defaultdict[int, deque[Array]]] = defaultdict(
            lambda: defaultdict(deque)
        )
        self._settling: dict[int, asyncio.Future[None]] = {}  # tag -> latest recv_any

    async def recv(
        self,
        comm: Communicator,
        src: int,
        tag: int,
        timeout: float,  # noqa: ASYNC109 (dsml's recv takes it)
    ) -> Array:
        """The next message from `src` with `tag`."""
        await self._after_earlier(tag)
        kept = self._kept[tag][src]
        if kept:
            return kept.popleft()
        return await comm.recv(src, tag=tag, timeout=timeout)

    async def recv_any(
        self,
        comm: Communicator,
        tag: int,
        timeout: float,  # noqa: ASYNC109 (dsml's recv takes it)
    ) -> tuple[int, Array]:
        """(source rank, message): the first message with `tag` from any other rank."""
        earlier = self._settling.get(tag)
        settled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._settling[tag] = settled
        try:
            if earlier is not None:
                await asyncio.wait({earlier})
            for src, kept in sorted(self._kept[tag].items()):
                if kept:
                    return src, kept.popleft()
            return await self._first_of(comm, tag, timeout)
        finally:
            settled.set_result(None)
            if self._settling.get(tag) is settled:
                del self._settling[tag]

    async def _first_of(
        self,
        comm: Communicator,
        tag: int,
        timeout: float,  # noqa: ASYNC109 (dsml's recv takes it)
    ) -> tuple[int, Array]:
        """One receive per other rank; the first to complete wins, the others are
        cancelled, and what those completed anyway is kept for later receives."""
        # The receives themselves are cancelled, not the tasks awaiting them: a task
        # cancelled just after its receive completed would drop the message it got.
        handles = {
            src: comm.recv(src, tag=tag, timeout=timeout)
            for src in range(comm.world_size)
            if src != comm.rank
        }
        if not handles:
            raise ValueError("recv from any source in a group of one: nobody can send to it")
        waits = {src: asyncio.ensure_future(_awaited(h)) for src, h in handles.items()}
        try:
            await asyncio.wait(waits.values(), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for handle in handles.values():
                handle.cancel()  # no-op for those already done: their message is kept
            await asyncio.wait(waits.values())
        got = [
            (src, w.result())
            for src, w in waits.items()
            if not w.cancelled() and w.exception() is None
        ]
        if not got:  # every receive failed: the first error (by rank) is the call's
            errors = [w.exception() for w in waits.values() if not w.cancelled()]
            raise next(e for e in errors if e is not None)
        for src, message in got[1:]:
            self._kept[tag][src].append(message)
        return got[0]

    async def _after_earlier(self, tag: int) -> None:
        earlier = self._settling.get(tag)
        if earlier is not None:
            await asyncio.wait({earlier})

    def __repr__(self) -> str:
        kept = sum(len(q) for by_src in self._kept.values() for q in by_src.values())
        return f"<Receives kept={kept} settling={len(self._settling)}>"


def send(tensors: Tensors, dst: int, tag: int, timeout: float) -> Run:
    """Each tensor to rank `dst`, in order."""

    async def run(comm: Communicator) -> Tensors:
        await _all([comm.send(t, dst, tag=tag, timeout=timeout) for t in tensors])
        return tensors

    return run


def recv(receives: Receives, tensors: Tensors, src: int, tag: int, timeout: float) -> Run:
    """Each tensor from rank `src`, in order (after any message kept for it)."""

    async def run(comm: Communicator) -> Tensors:
        for t in tensors:
            _copy_into(t, await receives.recv(comm, src, tag, timeout))
        return tensors

    return run


def recv_anysource(
    receives: Receives, state: RunState, tensors: Tensors, tag: int, timeout: float
) -> Run:
    """Each tensor from whichever rank sends first; `state.source` says which."""

    async def run(comm: Communicator) -> Tensors:
        for t in tensors:
            state.source, message = await receives.recv_any(comm, tag, timeout)
            _copy_into(t, message)
        return tensors

    return run


async def _awaited(handle: Any) -> Any:
    return await handle


async def monitored_barrier(
    comm: Communicator,
    timeout: float,  # noqa: ASYNC109 (the barrier's budget)
    wait_all_ranks: bool,
) -> None:
    """gloo's monitored barrier: rank 0 checks in every rank, then lets them go."""
    token = np.zeros(1, dtype=np.int8)
    rank, tag = comm.rank, MONITORED_BARRIER_TAG
    if rank != 0:
        try:
            await comm.send(token, 0, tag=tag, timeout=timeout)
            await comm.recv(0, tag=tag, timeout=timeout)
        except DsmlError as exc:
            raise RuntimeError(
                f"Rank {rank} successfully reached monitoredBarrier, but received errors "
                "while waiting for send/recv from rank 0. Please check rank 0 logs for "
                f"faulty rank. ({type(exc).__name__}: {exc})"
            ) from exc
        return
    start, ms = time.monotonic(), int(timeout * 1000)
    missing: list[int] = []
    for src in range(1, comm.world_size):
        left = timeout - (time.monotonic() - start)
        if left <= 0:
            raise RuntimeError(f"Rank 0 timed out in monitoredBarrier after {ms} ms.")
        try:
            await comm.recv(src, tag=tag, timeout=left)
        except DsmlError:
            if not wait_all_ranks:
                raise RuntimeError(
                    f"[Rank 0]: Rank {src} failed to pass monitoredBarrier in {ms} ms"
                ) from None
            missing.append(src)
    if missing:
        ranks = ", ".join(map(str, missing))
        raise RuntimeError(f"[Rank 0]: Ranks {ranks} failed to pass monitoredBarrier in {ms} ms")
    for dst in range(1, comm.world_size):
        await comm.send(token, dst, tag=tag, timeout=timeout)
