"""The user-facing communicator: collectives, point-to-point, its engine (communicator).

Each method validates its arguments on this rank, takes the next collective id (program
order is collective order), and starts the operation at once (see `runner.py`); it returns
a `CollectiveHandle` to await. `comm.engine` and `comm.var` connect the dependency engine:
collectives pushed with `comm.var` among their mutated vars are issued in push order.

The class is made of parts, one module each: `CommunicatorInfo` (comm_info.py: identity,
views, device, engine, statistics and traces), `CommunicatorCalls` (comm_calls.py:
collectives, point-to-point, engine pushes) and `CommunicatorGroups` (comm_groups.py:
`split`, `new_group`). This module wires the parts together (`__init__`, `open`) and
closes them (`aclose`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

from ..collectives.cost_auto import AutoChooser
from ..config import CommConfig
from ..errors import CollectiveAbortedError
from ..membership import RegistryClient, View
from ..transport.addresses import host_of
from ..wire import Fingerprint
from .call_table import CallTable
from .comm_groups import CommunicatorGroups
from .engine_link import EngineLink
from .links import PeerLinks
from .p2p import PointToPoint
from .placement import Placement
from .plans import Planner
from .runner import Runner
from .shm_hook import ShmHook
from .subgroups import Demux
from .survival import Survival
from .tasks import TaskOwner
from .view_changes import ViewChanges

__all__ = ["Communicator"]

CLOSE_GRACE_S = 2.0  # how long closing waits for background sends (goodbyes, aborts)
_DRAIN_S = 1.0  # how long a graceful close lets the calls in flight finish


class Communicator(CommunicatorGroups):
    """A member of a group. Create with `dsml.init`; close with `aclose()`.

    The constructor only wires the parts together; `open(view)` installs the first view
    and starts talking to the registry (listener, heartbeats).
    """

    def __init__(
        self,
        links: PeerLinks,
        tasks: TaskOwner,
        registry: RegistryClient,
        config: CommConfig,
        loop: asyncio.AbstractEventLoop,
        device: str = "cpu",
    ) -> None:
        self.config = config
        self._links = links
        self._tasks = tasks
        self._registry = registry
        self._table = CallTable(links, config)
        self._views = ViewChanges(self._table, links, registry, config.view_timeout)
        self._survival = Survival(links, self._views, registry, tasks)
        self._placement = Placement(device, config.gpu_reduce, config.chunk_bytes)
        self._auto = AutoChooser(  # what `auto` runs across hosts (docs/auto.md)
            lambda: links.epoch,
            lambda: host_keys(links.view),
            default_chunk_bytes=config.chunk_bytes,
            max_chunk_bytes=config.max_frame_bytes,
            frame_limit=lambda: frame_limit(links.view),
        )
        self._shm = ShmHook(config, self._table)  # same-host shared memory (shm_hook.py)
        self._views.listeners.append(lambda _old, new: self._shm.set_view(new))
        planner = Planner(config.chunk_bytes, self._placement, self._auto, self._shm)
        self._runner = Runner(self._table, self._views, planner, tasks, config, loop)
        self._p2p = PointToPoint(self._table, self._placement, self._tasks)
        self._views.listeners.append(lambda _old, _new: self._p2p.reset())
        self._engine_link = EngineLink(
            self._runner, self._start, lambda: (self.rank, self.epoch), trace=config.engine_trace
        )
        self._on_close: list[Callable[[], Awaitable[None]]] = []
        links.said_goodbye = self._table.closed_after.__contains__
        links.on_bug = tasks.on_crash = self._fail
        self._loop = loop
        self._demux = Demux(self._table.inbound)  # the parent's messages, and sub-groups'
        self._splits = 0  # split/new_group calls so far: numbers sub-groups alike everywhere
        self._nested_groups = 0  # numbers this rank reserved for nested splits (subgroups.py)
        self._subs: list[Communicator] = []
        self._views.listeners.append(lambda _old, _new: self._demux.new_epoch())

    def open(self, view: View) -> None:
        """Install the first view, route peer messages, and start listening to the registry
        and sending heartbeats."""
        self._links.route(self._demux.routes)
        self._views.install_first(view)
        self._shm.set_view(view)
        self._registry.attach(self._views)
        self._registry.start_heartbeats(self._progress)
        self._survival.start()

    def _fail(self, exc: BaseException) -> None:
        """A bug in this communicator's own machinery: fail every call, now and later, and
        tell the peers (as a goodbye with the error), so that theirs fail too."""
        if self._runner.broken is None:
            self._links.say_goodbye(self._table.next_cid - 1, f"internal error: {exc!r}")
        self._runner.fail(
            CollectiveAbortedError(
                f"the communicator of rank {self._links.rank} failed on an internal error "
                f"({exc!r}; its traceback is in the log). Its calls cannot complete: close it "
                "(and please report the bug)",
                origin=self._links.rank,
                rank=self._links.rank,
                epoch=self._links.epoch,
            )
        )

    def on_close(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Await fn() at the end of `aclose` (dsml.init: the registry this rank serves)."""
        self._on_close.append(fn)

    def _progress(self) -> dict[str, Any]:
        """A heartbeat's body (read from the heartbeat thread: plain attribute reads)."""
        started, finished = self._table.started, self._table.finished
        counters = self._links.counters
        return {
            "epoch": self._links.epoch,
            "started": _described(started),
            "finished": _described(finished),
            "counters": {
                "held": self._links.held_now,
                "held_total": counters["held"],
                "dropped": self._links.dropped_total,
                "dropped_foreign": counters["dropped_foreign"],
                "dropped_over_budget": counters["dropped_over_budget"],
                "stale": counters["stale"],
            },
        }

    # -- lifecycle --------------------------------------------------------------------------

    async def aclose(self, *, error: BaseException | None = None, cancel: bool = False) -> None:
        """Close: finish (or with `cancel`, cancel) engine ops, cancel calls in flight, say
        goodbye to the peers, leave the group, close the sockets.

        `error` (set when `async with` exits by an exception) tells the peers why this rank
        left, so their pending and later calls fail naming it instead of waiting.
        """
        if self._runner.closed:
            return
        self._survival.stop()
        for sub in list(self._subs):  # they say goodbye in their group before we do
            await sub.aclose(error=error, cancel=cancel)
        await self._engine_link.aclose(cancel=cancel or error is not None)
        if error is None:  # a graceful leave: calls in flight end as they would
            await self._runner.drain(_DRAIN_S)
        withheld = self._runner.withdraw_cancel_aborts()
        in_flight = min((cid for _epoch, cid in self._table.calls), default=None)
        await self._runner.cancel_all()
        self._shm.close()
        reason = f"{type(error).__name__}: {error}" if error is not None else None
        # The peers fail every call after `last` as a member leaving: the first call this
        # rank did not finish (cancelled by an interrupt, or still in flight) is the one.
        unfinished = [cid for cid in (withheld, in_flight) if cid is not None]
        last = min(unfinished) - 1 if unfinished else self._table.next_cid - 1
        epoch = self._links.epoch  # the numbering `last` counts in
        await self._p2p.settle(CLOSE_GRACE_S)  # refused sends say why before the goodbye
        self._links.say_goodbye(last, reason)  # peers hear why first: the goodbye carries it
        await self._tasks.aclose(CLOSE_GRACE_S)  # flushes the goodbye and other sends
        await self._links.aclose()
        try:
            if not self._views.evicted:
                await self._registry.leave(last, epoch)
        finally:
            await self._registry.aclose()
            for fn in self._on_close:
                await fn()

    async def _crash(self) -> None:
        """Stop as if the process had been killed: no goodbye, no leave, sockets closed
        at once, calls in flight cancelled (see `dsml.testing.crash`)."""
        if self._runner.closed:
            return
        for sub in list(self._subs):
            await sub._crash()
        self._registry.stop_heartbeats()
        self._survival.stop()
        await self._links.crash()
        await self._registry.aclose(linger_s=0.0)
        await self._runner.cancel_all()
        self._shm.close()
        await self._engine_link.aclose(cancel=True)
        await self._tasks.cancel_all()

    async def __aenter__(self) -> Communicator:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        error = exc if isinstance(exc, Exception) else None
        await self.aclose(error=error, cancel=exc_type is not None)

    def __repr__(self) -> str:
        if self._links.view is None:
            return "<Communicator (not joined)>"
        state = " closed" if self._runner.closed else ""
        return (
            f"<Communicator rank={self.rank}/{self.world_size} epoch={self.epoch} "
            f"address={self.address} in_flight={len(self._table.calls)}{state}>"
        )


def _described(mark: tuple[int, int, Fingerprint] | None) -> list[Any] | None:
    """A call table's (epoch, cid, fingerprint) as a heartbeat reports it."""
    return None if mark is None else [mark[0], mark[1], mark[2].describe()]


def frame_limit(view: View | None) -> int:
    """The smallest payload frame a member of the view accepts (0: none said)."""
    said = [m.max_frame for m in view.members if m.max_frame > 0] if view is not None else []
    return min(said, default=0)


def host_keys(view: View | None) -> list[str]:
    """Per rank, where it runs: host name and IP (equal keys share a machine's network)."""
    if view is None:
        return []
    return [f"{m.host}/{host_of(m.address)}" for m in view.members]
