"""The user-facing communicator: collectives, point-to-point, its engine (communicator).

Each method validates its arguments on this rank, takes the next collective id (program
order is collective order), and starts the operation at once (see `runner.py`); it returns
a `CollectiveHandle` to await. `comm.engine` and `comm.var` connect the dependency engine:
collectives pushed with `comm.var` among their mutated vars are issued in push order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from collections.abc import Awaitable, Callable, Iterable, Sequence
from os import PathLike
from types import TracebackType
from typing import Any, TypeVar

import numpy as np

from ..collectives.cost import Choice, CostModel
from ..collectives.cost_auto import AutoChooser
from ..collectives.interop import native_arrays, with_native  # torch, JAX, DLPack, buffers
from ..config import CommConfig
from ..engine import Engine, OpHandle, Tagged, Var
from ..engine.trace import TraceRecorder
from ..errors import CollectiveAbortedError, ConfigError, MembershipChangedError
from ..membership import RegistryClient, View
from ..wire import Fingerprint
from . import subgroups
from .call import Call
from .call_table import CallTable
from .collective_handle import CollectiveHandle
from .engine_link import EngineLink
from .links import PeerLinks
from .p2p import PointToPoint
from .placement import Placement
from .plans import Planner, Request
from .runner import Runner
from .shm_hook import ShmHook
from .subgroups import Demux
from .survival import Survival
from .tasks import TaskOwner
from .view_changes import ViewChanges, ViewListener

__all__ = ["Communicator"]

T = TypeVar("T")
Array = Any

_CLOSE_GRACE_S = 2.0  # how long closing waits for background sends (goodbyes, aborts)
_DRAIN_S = 1.0  # how long a graceful close lets the calls in flight finish


class Communicator:
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
        )
        self._shm = ShmHook(config, self._table)  # same-host shared memory (shm_hook.py)
        self._views.listeners.append(lambda _old, new: self._shm.set_view(new))
        planner = Planner(config.chunk_bytes, self._placement, self._auto, self._shm)
        self._runner = Runner(self._table, self._views, planner, tasks, config, loop)
        self._p2p = PointToPoint(self._table, self._placement)
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

    # -- identity ---------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This worker's rank in the view its next collective runs in (0..world_size-1)."""
        view = self.view
        rank = view.rank_of(self._links.member_id)
        return rank if rank is not None else self._links.rank

    @property
    def world_size(self) -> int:
        """Members of the view the next collective runs in."""
        return self.view.size

    @property
    def epoch(self) -> int:
        """The epoch of that view; it grows with every change of membership."""
        return self.view.epoch

    @property
    def view(self) -> View:
        """The view (epoch, members in ring order) the next collective runs in, as far as
        this rank knows; after a member was lost, the survivors' view once it is known."""
        return self._views.next_view()

    @property
    def member_id(self) -> str:
        return self._links.member_id

    @property
    def address(self) -> str:
        """The address this worker's endpoint serves on."""
        assert self._links.view is not None
        return self._links.view.members[self._links.rank].address

    @property
    def evicted(self) -> bool:
        """Whether the registry declared this worker dead; it must join again."""
        return self._views.evicted

    @property
    def interrupt_on_join(self) -> bool:
        """When true, the first collective after members joined raises
        `MembershipChangedError` instead of running, so the application can bring the
        joiners up to date first (`dsml.elastic.run` sets it)."""
        return self._views.interrupt_on_join

    @interrupt_on_join.setter
    def interrupt_on_join(self, value: bool) -> None:
        self._views.interrupt_on_join = bool(value)

    def on_view_change(self, callback: ViewListener) -> Callable[[], None]:
        """Call `callback(old_view, new_view)` each time this rank switches views (on the
        loop, at a collective boundary); returns a function that removes it."""
        self._views.listeners.append(callback)
        return lambda: self._views.listeners.remove(callback)

    async def wait_view_change(self, timeout: float | None = None) -> View:  # noqa: ASYNC109
        """Wait until the registry announces a view newer than the current one (a member
        lost, left or joined); returns it. It is used from the next collective on."""
        return await self._views.wait_known(timeout)

    @property
    def registry_address(self) -> str:
        return self._registry.address

    @property
    def device(self) -> str:
        """ "cpu" or "cuda:N": where arrays this communicator creates without an input go
        (`recv`, `scatter` on non-roots). Collectives on an array work on its own device."""
        return self._placement.device

    @property
    def cost_model(self) -> CostModel | None:
        """The cost model measured on this view, which `auto` chooses from (docs/auto.md).

        None on a single host (a measured size table decides there) and, across hosts,
        until the view's first `auto` all_reduce has measured it.
        """
        return self._auto.model

    def all_reduce_choice(self, nbytes: int) -> Choice:
        """What `all_reduce(algorithm="auto")` runs now for an array of nbytes."""
        return self._auto.choice(nbytes, self._links.size)

    def statistics(self) -> dict[str, int]:
        """Counters of the data plane: messages dropped as malformed, of an older epoch
        (stale), for a finished call (late), held for a view not seen yet; calls in flight."""
        return {
            "dropped": self._links.dropped_total,
            "stale": self._links.counters["stale"] + self._table.counters["stale"],
            "late": self._table.counters["late"],
            "held": self._links.counters["held"],
            "dropped_foreign": self._links.counters["dropped_foreign"],
            "dropped_over_budget": self._links.counters["dropped_over_budget"],
            "disconnects": self._links.counters["disconnects"],
            "views_installed": self._views.installed,
            "in_flight": len(self._table.calls),
            "next_cid": self._table.next_cid,
        }

    def stats(self) -> list[dict[str, Any]]:
        """The recent collectives of this rank (oldest first, at most 256), with where their
        time went.

        Each is a dict: `kind`, `cid`, `epoch`, `bytes`, `algorithm` (what `auto` chose),
        `outcome` ("ok", "running", "cancelled" or the error's type), and seconds:
        `total_s` and its split `waiting_s` (for peers to arrive), `wire_s` (data in
        flight, full queues), `reduce_s`, `copy_s`, `other_s` (the rest). See
        docs/observability.md.
        """
        return [record.as_dict() for record in self._runner.stats.recent]

    def trace(self) -> dict[str, Any]:
        """The recent collectives, and the engine's ops when it records them
        (`CommConfig(engine_trace=True)`), as one Chrome / Perfetto trace-event dict."""
        spans = [record.span() for record in self._runner.stats.recent]
        if self.config.engine_trace:
            return self.engine.trace(extra=spans)
        recorder = TraceRecorder()
        if spans:
            recorder.origin = min(span.start for span in spans)
        return recorder.chrome_trace(f"dsml rank {self.rank}", spans)

    def write_trace(self, path: str | PathLike[str]) -> None:
        """Write `trace()` to `path` as JSON (open it at https://ui.perfetto.dev)."""
        with open(path, "w", encoding="utf-8") as file:
            json.dump(self.trace(), file)

    # -- collectives ------------------------------------------------------------------------
    # Each method builds a `Request` and starts it (`_start`); see docs/architecture.md.

    @native_arrays(writes=True)
    def all_reduce(
        self, x: Array, op: Any = "sum", *, algorithm: str = "auto", timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Reduce x over all ranks, in place on every rank; the handle gives x."""
        return self._start(Request("all_reduce", x, op=op, algorithm=algorithm, timeout=timeout))

    @native_arrays(writes=True)
    def reduce(
        self, x: Array, root: int = 0, op: Any = "sum", *, timeout: float | None = None
    ) -> CollectiveHandle[Array | None]:
        """Reduce x onto root (in place there); other ranks get None and keep x."""
        return self._start(Request("reduce", x, op=op, root=root, timeout=timeout))

    @native_arrays(writes=True)
    def broadcast(
        self, x: Array, root: int = 0, *, timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Copy root's x into every rank's x (same shape and dtype); the handle gives x."""
        return self._start(Request("broadcast", x, root=root, timeout=timeout))

    @native_arrays(writes=False)
    def all_gather(self, x: Array, *, timeout: float | None = None) -> CollectiveHandle[Array]:
        """Every rank's x concatenated along axis 0 in rank order (a new array)."""
        return self._start(Request("all_gather", x, timeout=timeout))

    @native_arrays(writes=False)
    def gather(
        self, x: Array, root: int = 0, *, timeout: float | None = None
    ) -> CollectiveHandle[Array | None]:
        """Like all_gather, but only root gets the result; others get None."""
        return self._start(Request("gather", x, root=root, timeout=timeout))

    @native_arrays(writes=False)
    def scatter(
        self, x: Array | None = None, root: int = 0, *, timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Rank r receives numpy.array_split(root's x, world_size)[r]; non-roots pass None."""
        return self._start(Request("scatter", x, root=root, timeout=timeout))

    @native_arrays(writes=False)
    def reduce_scatter(
        self, x: Array, op: Any = "sum", *, timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Rank r receives the reduction of numpy.array_split(x, world_size)[r]."""
        return self._start(Request("reduce_scatter", x, op=op, timeout=timeout))

    @native_arrays(writes=False)
    def all_to_all(self, x: Array, *, timeout: float | None = None) -> CollectiveHandle[Array]:
        """Part j of numpy.array_split(x, world_size) goes to rank j; parts received are
        concatenated in rank order."""
        return self._start(Request("all_to_all", x, timeout=timeout))

    def barrier(self, *, timeout: float | None = None) -> CollectiveHandle[None]:
        """Return once every rank has entered the barrier."""
        return self._start(Request("barrier", timeout=timeout))

    def _start(self, request: Request) -> CollectiveHandle[Any]:
        """Start a collective on the communicator's loop: queued behind collectives pushed
        into the engine if some wait to be issued, else at once (`Runner.collective`)."""
        if type(request.x) is not np.ndarray:  # numpy needs no stream
            caller = self._placement.caller_stream(request.x)  # per thread: read it here
            if caller is not None:
                request = dataclasses.replace(request, caller=caller)
        if self._runner.on_own_loop():  # the usual case: no hop to the loop to make
            return self._issue(request)
        return self._runner.on_loop(functools.partial(self._issue, request))

    def _issue(self, request: Request) -> CollectiveHandle[Any]:
        if self._engine_link.must_queue():
            return self._engine_link.queue(request)
        return self._runner.collective(request)

    # -- sub-communicators ------------------------------------------------------------------

    async def split(
        self,
        color: int | None,
        key: int | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the all_gather's, as on every call)
    ) -> Communicator | None:
        """Split the group into sub-communicators, one per colour (MPI_Comm_split).

        Every rank calls it (it is a collective). Ranks that pass the same `color` (an int
        >= 0) form one sub-communicator, ranked by `key` (default 0), ties broken by their
        rank here; a rank that passes None gets None. Collectives on a sub-communicator run
        concurrently with this communicator's; a lost member fails the calls of both, and
        after a change of view the sub-communicator refuses calls (split again).

        Raises:
            ConfigError: on every rank, if any rank passed an invalid color or key.
        """
        index = self._take_split()
        valid = subgroups.check_split_args(color, key)
        row = [int(valid), int(color is not None and valid), 0, 0]
        if valid:
            row[2], row[3] = color or 0, key or 0
        rows = await self.all_gather(np.array([row], dtype=np.int64), timeout=timeout)
        self._check_same_view(len(rows))
        bad = [r for r, (ok, *_rest) in enumerate(rows.tolist()) if not ok]
        if bad:
            raise ConfigError(
                f"comm.split: rank(s) {bad} passed an invalid color or key (color: an int >= 0 "
                "or None; key: an int or None); no sub-communicator was made"
            )
        mine = subgroups.split_members([r[1:] for r in rows.tolist()], self._links.rank)
        if mine is None:
            return None
        color_index, members = mine
        return self._sub(subgroups.group_id(index, color_index), members)

    async def new_group(
        self,
        ranks: Sequence[int],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the all_gather's, as on every call)
    ) -> Communicator | None:
        """A sub-communicator of `ranks` (sub-rank i is ranks[i]); None on other ranks.

        Every rank calls it with the same list (it is a collective).

        Raises:
            ConfigError: on every rank, if the lists differ or one is invalid.
        """
        index = self._take_split()
        members = list(ranks) if isinstance(ranks, Sequence) else []
        valid = (
            bool(members)
            and all(type(r) is int and 0 <= r < self.world_size for r in members)
            and len(set(members)) == len(members)
        )
        row = np.array([int(valid), *(members if valid else [])], dtype=np.int64)
        flat = (await self.all_gather(row, timeout=timeout)).tolist()
        self._check_same_view(self._links.size)
        lists, at = [], 0
        for _ in range(self.world_size):  # each rank's row: valid, then its ranks if valid
            ok = flat[at]
            count = len(members) if ok and valid else 0
            if ok and not valid:
                raise ConfigError(
                    f"comm.new_group: rank {self.rank} passed an invalid list {ranks!r} "
                    f"(distinct ranks in 0..{self.world_size - 1}); no group was made"
                )
            lists.append(flat[at + 1 : at + 1 + count] if ok else None)
            at += 1 + count
        if at != len(flat) or any(other != members for other in lists):
            raise ConfigError(
                "comm.new_group: the ranks did not all pass the same valid list of ranks "
                f"(this rank passed {ranks!r}); no group was made"
            )
        if self._links.rank not in members:
            return None
        return self._sub(subgroups.group_id(index, 0), members)

    def _check_same_view(self, gathered: int) -> None:
        """The group must not have changed between the all_gather and making the group."""
        if gathered != self._links.size:
            raise MembershipChangedError(
                f"the group changed while rank {self._links.rank} was splitting it (epoch "
                f"{self._links.epoch}); split again once the new view is in place",
                rank=self._links.rank,
                epoch=self._links.epoch,
            )

    def _take_split(self) -> int:
        if isinstance(self._links, subgroups.SubLinks):
            raise ConfigError("a sub-communicator cannot be split again: split its parent instead")
        self._splits += 1
        return self._splits

    def _sub(self, group: int, members: list[int]) -> Communicator:
        from .sub_communicator import SubCommunicator

        sub = SubCommunicator(self, group, members)
        self._subs.append(sub)
        return sub

    # -- point to point ---------------------------------------------------------------------

    @native_arrays(writes=False)
    def send(
        self, x: Array, dst: int, *, tag: int = 0, timeout: float | None = None
    ) -> CollectiveHandle[None]:
        """Send x to rank dst; ordered per (source, destination, tag).

        The handle completes once x may be modified again (not when dst has received it).
        """
        caller = self._placement.caller_stream(x)

        def start() -> CollectiveHandle[None]:
            self._views.ensure_current()
            budget = self._runner.budget(timeout)
            dst_, tag_, fp, send = self._p2p.plan_send(x, dst, tag, caller)
            call = Call(self._table, 0, fp, budget, peer=dst_, tag=tag_)
            what = f"send to rank {dst_} (tag {tag_})"
            hint = f"is rank {dst_} alive and connected?"
            return self._runner.p2p(call, send(call), what, hint)

        return self._runner.on_loop(start)

    def recv(
        self, src: int, *, tag: int = 0, timeout: float | None = None
    ) -> CollectiveHandle[Array]:
        """Receive the next array rank src sent with this tag (a new array on comm.device)."""

        def start() -> CollectiveHandle[Array]:
            self._views.ensure_current()
            budget = self._runner.budget(timeout)
            peer, tag_ = self._p2p.plan_recv(src, tag)
            call = Call(self._table, 0, Fingerprint("recv"), budget, peer=peer, tag=tag_)
            what = f"recv from rank {peer} (tag {tag_})"
            hint = (
                f"rank {peer} has not sent it: check that it calls send(x, {self.rank}, tag={tag_})"
            )
            return self._runner.p2p(call, self._p2p.receive(call, peer, tag_), what, hint)

        return self._runner.on_loop(start)

    # -- the dependency engine --------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """This rank's dependency engine (created on first use, closed with the communicator)."""
        return self._engine_link.engine

    @property
    def var(self) -> Var:
        """The var that orders collectives in the engine: push them with it in `mutate`."""
        return self._engine_link.var

    def push_all_reduce(
        self,
        tagged: Tagged[Array],
        op: Any = "sum",
        *,
        read: Iterable[Var] = (),
        algorithm: str = "auto",
        timeout: float | None = None,
    ) -> OpHandle[Array]:
        """Push `all_reduce(tagged.data, op)` into the engine; returns the op's handle.

        Two ops are pushed. The first waits for earlier writers of `tagged.var` (and for
        `read`) and for the previous collective to be *issued* (it mutates `comm.var`), then
        starts the all_reduce; the second waits for it to finish and mutates `tagged.var`,
        so later readers of the data see the result. Collectives are thus issued in push
        order on every rank yet several can be in flight. The first op takes its turn even
        if `tagged.var` is poisoned: it then fails the collective on every rank instead of
        leaving the ranks' collective ids out of step. `algorithm` and `timeout` are
        all_reduce's.
        """
        return with_native(  # torch, JAX, DLPack data: as for all_reduce
            tagged.data,
            True,
            lambda data: self._engine_link.push_collective(
                tagged,
                read,
                Request("all_reduce", data, op=op, algorithm=algorithm, timeout=timeout),
            ),
        )

    def push_broadcast(
        self, tagged: Tagged[Array], root: int = 0, *, timeout: float | None = None
    ) -> OpHandle[Array]:
        """Push `broadcast(tagged.data, root)` into the engine (see `push_all_reduce`)."""
        return with_native(
            tagged.data,
            True,
            lambda data: self._engine_link.push_collective(
                tagged, (), Request("broadcast", data, root=root, timeout=timeout)
            ),
        )

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
        self._links.say_goodbye(last, reason)  # peers hear why first: the goodbye carries it
        await self._tasks.aclose(_CLOSE_GRACE_S)  # flushes the goodbye and other sends
        await self._links.aclose()
        try:
            if not self._views.evicted:
                await self._registry.leave(last)
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


def host_keys(view: View | None) -> list[str]:
    """Per rank, where it runs: host name and IP (equal keys share a machine's network)."""
    if view is None:
        return []
    return [f"{m.host}/{m.address.split('://', 1)[-1].rsplit(':', 1)[0]}" for m in view.members]
