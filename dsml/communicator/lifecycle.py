"""Opening and closing the root communicator (communicator layer).

`open_root` makes the communicator of `dsml.init`: its `Session` over views that follow
the registry's, an `auto` chooser that measures a cost model across hosts, shared memory
between same-host ranks, and the demultiplexer of its sub-groups' messages.

`RootLife` is what only that communicator does over its session: install the first view,
route the peers' messages (its own and its sub-groups', through `Demux`), talk to the
registry (listener, heartbeats), watch for lost peers (`Survival`), fail as a whole on an
internal error, and close: drain or cancel the calls in flight, say goodbye, leave the
group. A sub-group's counterpart is `SubLife` (sub_communicator.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from ..collectives.cost_auto import AutoChooser
from ..config import CommConfig
from ..errors import CollectiveAbortedError
from ..membership import RegistryClient, View
from ..wire import Envelope, Fingerprint
from .call_table import CallTable
from .communicator import Communicator
from .flight import install_signal_handler
from .groups import Groups
from .links import PeerLinks
from .placement import Placement
from .session import CLOSE_GRACE_S, Session, frame_limit, host_keys
from .shm_hook import ShmHook
from .sub_communicator import open_sub
from .subgroups import Demux
from .summary import summary
from .survival import Survival
from .tasks import TaskOwner
from .view_changes import ViewChanges

__all__ = ["RootLife", "open_root"]

_DRAIN_S = 1.0  # how long a graceful close lets the calls in flight finish


def open_root(
    links: PeerLinks,
    tasks: TaskOwner,
    registry: RegistryClient,
    config: CommConfig,
    device: str,
    view: View,
) -> Communicator:
    """The communicator of `dsml.init`, in its first view, talking to the registry."""
    table = CallTable(links, config)
    views = ViewChanges(table, links, registry, config.view_timeout)
    placement = Placement(device, config.gpu_reduce, config.chunk_bytes)
    auto = AutoChooser(  # what `auto` runs across hosts (docs/auto.md)
        lambda: links.epoch,
        lambda: host_keys(links.view),
        default_chunk_bytes=config.chunk_bytes,
        max_chunk_bytes=config.max_frame_bytes,
        frame_limit=lambda: frame_limit(links.view),
    )
    shm = ShmHook(config, table)  # same-host shared memory (shm_hook.py)
    demux = Demux(table.inbound)  # the root's messages, and its sub-groups'
    loop = asyncio.get_running_loop()
    session = Session(
        config,
        loop,
        tasks,
        registry,
        links,
        table,
        views,
        placement,
        auto,
        shm,
        demux,
        flight_dir=config.flight_dir,
    )
    if config.flight_dir:
        install_signal_handler()  # SIGUSR1 writes the record (main thread only)
    views.listeners.append(lambda _old, new: shm.set_view(new))
    views.listeners.append(lambda _old, _new: session.p2p.reset())
    views.listeners.append(lambda _old, _new: demux.new_epoch())
    life = RootLife(session, views, shm, demux)
    comm = Communicator(
        session, life, lambda c: Groups(c, session, open_sub, views.sub_group_error)
    )
    life.open(view)
    return comm


class RootLife:
    """See the module docstring. `open(view)` once; `aclose` or `crash` once."""

    def __init__(self, session: Session, views: ViewChanges, shm: ShmHook, demux: Demux) -> None:
        self._s = session
        self._views = views
        self._shm = shm
        self._demux = demux
        self._survival = Survival(session.links, views, session.registry, session.tasks)
        self._on_close: list[Callable[[], Awaitable[None]]] = []
        views.use_survival(self._survival)
        session.links.listen(self)  # the `LinkEvents` below
        session.tasks.report_crashes(self.fail)

    # -- what the links tell (links.LinkEvents) ---------------------------------------------

    def peer_lost(self, member_id: str) -> None:
        self._views.peer_disconnected(member_id)

    def said_goodbye(self, rank: int) -> bool:
        return rank in self._s.table.closed_after

    def membership(self, rank: int, env: Envelope) -> None:
        self._survival.handle_message(rank, env)

    def bug(self, exc: BaseException) -> None:
        self.fail(exc)

    # -- lifecycle --------------------------------------------------------------------------

    def open(self, view: View) -> None:
        """Install the first view, route peer messages, and start listening to the registry
        and sending heartbeats."""
        s = self._s
        s.links.route(self._demux.routes)
        self._views.install_first(view)
        self._shm.set_view(view)
        s.registry.attach(self._views)
        s.registry.start_heartbeats(self.progress)
        self._survival.start()

    def on_close(self, fn: Callable[[], Awaitable[None]]) -> None:
        self._on_close.append(fn)

    def fail(self, exc: BaseException) -> None:
        """A bug in this communicator's own machinery: fail every call, now and later, and
        tell the peers (as a goodbye with the error), so that theirs fail too."""
        s = self._s
        if s.runner.broken is None:
            s.links.say_goodbye(s.table.next_cid - 1, f"internal error: {exc!r}")
        s.runner.fail(
            CollectiveAbortedError(
                f"the communicator of rank {s.links.rank} failed on an internal error "
                f"({exc!r}; its traceback is in the log). Its calls cannot complete: close it "
                "(and please report the bug)",
                origin=s.links.rank,
                rank=s.links.rank,
                epoch=s.links.epoch,
            )
        )

    def progress(self) -> dict[str, Any]:
        """A heartbeat's body (read from the heartbeat thread: plain attribute reads)."""
        links = self._s.links
        started, finished = self._s.table.started, self._s.table.finished
        counters = links.counters
        return {
            "epoch": links.epoch,
            "started": _described(started),
            "finished": _described(finished),
            "summary": summary(self._s.runner.stats, links.epoch),
            "counters": {
                "held": links.held_now,
                "held_total": counters["held"],
                "dropped": links.dropped_total,
                "dropped_foreign": counters["dropped_foreign"],
                "dropped_over_budget": counters["dropped_over_budget"],
                "stale": counters["stale"],
            },
        }

    async def aclose(self, groups: Groups, error: BaseException | None, cancel: bool) -> None:
        """`Communicator.aclose` of the root: its sub-groups first, then its own calls,
        the goodbye, the links and the registry."""
        s = self._s
        self._survival.stop()
        await groups.aclose(error, cancel)  # they say goodbye in their group before we do
        await s.engine_link.aclose(cancel=cancel or error is not None)
        if error is None:  # a graceful leave: calls in flight end as they would
            await s.runner.drain(_DRAIN_S)
        withheld = s.calls.withdraw_cancel_aborts()
        in_flight = min((cid for _epoch, cid in s.table.calls), default=None)
        await s.runner.cancel_all()
        self._shm.close()
        reason = f"{type(error).__name__}: {error}" if error is not None else None
        # The peers fail every call after `last` as a member leaving: the first call this
        # rank did not finish (cancelled by an interrupt, or still in flight) is the one.
        unfinished = [cid for cid in (withheld, in_flight) if cid is not None]
        last = min(unfinished) - 1 if unfinished else s.table.next_cid - 1
        epoch = s.links.epoch  # the numbering `last` counts in
        await s.p2p.settle(CLOSE_GRACE_S)  # refused sends say why before the goodbye
        s.links.say_goodbye(last, reason)  # peers hear why first: the goodbye carries it
        await s.tasks.aclose(CLOSE_GRACE_S)  # flushes the goodbye and other sends
        await s.links.aclose()
        try:
            if not self._views.evicted:
                await s.registry.leave(last, epoch)
        finally:
            await s.registry.aclose()
            for fn in self._on_close:
                await fn()

    async def crash(self, groups: Groups) -> None:
        """Stop as if the process had been killed: no goodbye, no leave, sockets closed
        at once, calls in flight cancelled (see `dsml.testing.crash`)."""
        s = self._s
        await groups.crash()
        s.registry.stop_heartbeats()
        self._survival.stop()
        await s.links.crash()
        await s.registry.aclose(linger_s=0.0)
        await s.runner.cancel_all()
        self._shm.close()
        await s.engine_link.aclose(cancel=True)
        await s.tasks.cancel_all()


def _described(mark: tuple[int, int, Fingerprint] | None) -> list[Any] | None:
    """A call table's (epoch, cid, fingerprint) as a heartbeat reports it."""
    return None if mark is None else [mark[0], mark[1], mark[2].describe()]
