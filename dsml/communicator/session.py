"""The parts one communicator runs on, built once and owned by it (communicator layer).

A `Session` holds what every communicator has, the root one (`dsml.init`) and those of
its sub-groups (`comm.split`) alike: links to the peers, the call table, the views, the
runner that starts calls, point-to-point, the engine link, the device placement, and
(on the root only) the `auto` chooser and the same-host shared-memory plane. Each part
is made once, here or by `SubCommunicator`, and never replaced; `Communicator`
(communicator.py) reads them, `RootLife` and `SubLife` (lifecycle.py, sub_communicator.py)
open and close them.

The root's views also re-key the same-host plane, point-to-point and the demultiplexer
when they change (listeners added by `root_session`).

`Session.start` is the one way a collective starts: queued behind collectives pushed into
the engine while some wait to be issued, else at once (`Runner.collective`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from typing import Any

import numpy as np

from ..collectives.cost import Choice, CostModel
from ..collectives.cost_auto import AutoChooser
from ..config import CommConfig
from ..engine.trace import TraceRecorder
from ..errors import ConfigError
from ..membership import RegistryClient, View
from ..transport.addresses import host_of
from ..wire import Fingerprint
from .call import Call
from .call_table import CallTable
from .collective_handle import CollectiveHandle
from .engine_link import EngineLink
from .links import PeerLinks
from .p2p import PointToPoint
from .placement import Placement
from .plan_reductions import all_reduce_choice
from .plans import PlanState, Request
from .runner import Runner
from .shm_hook import ShmHook
from .subgroups import Demux
from .tasks import TaskOwner
from .view_changes import Views

__all__ = ["CLOSE_GRACE_S", "Session", "frame_limit", "host_keys"]

CLOSE_GRACE_S = 2.0  # how long closing waits for background sends (goodbyes, aborts)


class Session:
    """See the module docstring. The constructor wires the parts every communicator has;
    `root_session` (and `SubCommunicator`) make the links and views it runs on."""

    def __init__(
        self,
        config: CommConfig,
        loop: asyncio.AbstractEventLoop,
        tasks: TaskOwner,
        registry: RegistryClient,
        links: PeerLinks,
        table: CallTable,
        views: Views,
        placement: Placement,
        auto: AutoChooser | None = None,
        shm: ShmHook | None = None,
        demux: Demux | None = None,
        flight_dir: str | None = None,
    ) -> None:
        self.config = config
        self.loop = loop
        self.tasks = tasks
        self.registry = registry
        self.links = links
        self.table = table
        self.views = views
        self.placement = placement
        self.auto = auto  # None on a sub-group: the size table decides there
        self.shm = shm  # None on a sub-group: its calls run over the links
        self.demux = demux  # the root's: its peer messages and its sub-groups'
        # flight_dir: the root's writes flight records there (sub-groups' only on request)
        self.plans = PlanState(config.chunk_bytes, placement, auto, shm)
        self.runner = Runner(table, views, self.plans, tasks, config, loop, flight_dir)
        self.calls = self.runner.calls  # starts sends and receives (runner_calls.py)
        self.p2p = PointToPoint(table, self.placement, tasks)
        self.engine_link = EngineLink(
            self.runner, self.start, self.where, trace=config.engine_trace
        )

    # -- where the next call runs ------------------------------------------------------------

    @property
    def view(self) -> View:
        """The view the next collective runs in (the survivors' once known)."""
        return self.views.next_view()

    @property
    def rank(self) -> int:
        rank = self.view.rank_of(self.links.member_id)
        return rank if rank is not None else self.links.rank

    def where(self) -> tuple[int, int]:
        """(rank, epoch) of the next collective, for error messages."""
        return self.rank, self.view.epoch

    @property
    def cost_model(self) -> CostModel | None:
        """What `auto` chooses from across hosts (None on a sub-group: see `Communicator`)."""
        return None if self.auto is None else self.auto.model

    def all_reduce_choice(self, nbytes: int) -> Choice:
        """What `auto` runs now for a numpy array of nbytes (see `Communicator`)."""
        return all_reduce_choice(self.plans, nbytes, self.links.size)

    # -- starting a collective ---------------------------------------------------------------

    def start(self, request: Request) -> CollectiveHandle[Any]:
        """Start a collective on the communicator's loop: queued behind collectives pushed
        into the engine if some wait to be issued, else at once (`Runner.collective`)."""
        if type(request.x) is not np.ndarray:  # numpy needs no stream
            caller = self.placement.caller_stream(request.x)  # per thread: read it here
            if caller is not None:
                request = dataclasses.replace(request, caller=caller)
        if self.runner.on_own_loop():  # the usual case: no hop to the loop to make
            return self._issue(request)
        return self.runner.on_loop(functools.partial(self._issue, request))

    def _issue(self, request: Request) -> CollectiveHandle[Any]:
        if self.engine_link.must_queue():
            return self.engine_link.queue(request)
        return self.runner.collective(request)

    # -- point to point ----------------------------------------------------------------------

    def send(self, x: Any, dst: int, tag: int, timeout: float | None) -> CollectiveHandle[None]:
        """`Communicator.send`: planned and started on the communicator's loop."""
        caller = self.placement.caller_stream(x)

        def start() -> CollectiveHandle[None]:
            self.views.ensure_current()
            dst_, tag_, fp, send = self.p2p.plan_send(x, dst, tag, caller)
            try:
                budget = self.runner.budget(timeout)
            except ConfigError as exc:  # a bad timeout: refused like a bad array
                self.p2p.refuse(dst_, tag_, str(exc))
                raise
            call = Call(self.table, 0, fp, budget, peer=dst_, tag=tag_)
            what = f"send to rank {dst_} (tag {tag_})"
            hint = f"is rank {dst_} alive and connected?"
            return self.calls.p2p(call, send(call), what, hint)

        return self.runner.on_loop(start)

    def recv(self, src: int, tag: int, timeout: float | None) -> CollectiveHandle[Any]:
        """`Communicator.recv`: planned and started on the communicator's loop."""

        def start() -> CollectiveHandle[Any]:
            self.views.ensure_current()
            budget = self.runner.budget(timeout)
            peer, tag_ = self.p2p.plan_recv(src, tag)
            call = Call(self.table, 0, Fingerprint("recv"), budget, peer=peer, tag=tag_)
            what = f"recv from rank {peer} (tag {tag_})"
            hint = (
                f"rank {peer} has not sent it: check that it calls send(x, {self.rank}, tag={tag_})"
            )
            taken: list[Any] = []  # the message, once taken: back to the stream if given up
            body = self.p2p.receive(call, peer, tag_, taken)
            return self.calls.p2p(call, body, what, hint, lambda: self.p2p.give_back(taken))

        return self.runner.on_loop(start)

    # -- records ---------------------------------------------------------------------------

    def statistics(self) -> dict[str, int]:
        """`Communicator.statistics`: the links', the call table's and the views' counters."""
        links, table = self.links, self.table
        return {
            "dropped": links.dropped_total,
            "stale": links.counters["stale"] + table.counters["stale"],
            "late": table.counters["late"],
            "held": links.counters["held"],
            "dropped_foreign": links.counters["dropped_foreign"],
            "dropped_over_budget": links.counters["dropped_over_budget"],
            "disconnects": links.counters["disconnects"],
            "views_installed": self.views.installed,
            "in_flight": len(table.calls),
            "next_cid": table.next_cid,
        }

    def trace(self) -> dict[str, Any]:
        """`Communicator.trace`: the recent calls' spans, in the engine's trace if it has one."""
        spans = [record.span() for record in self.runner.stats.recent]
        if self.config.engine_trace:
            return self.engine_link.engine.trace(extra=spans)
        return TraceRecorder().chrome_trace(f"dsml rank {self.rank}", spans)


def frame_limit(view: View | None) -> int:
    """The smallest payload frame a member of the view accepts (0: none said)."""
    said = [m.max_frame for m in view.members if m.max_frame > 0] if view is not None else []
    return min(said, default=0)


def host_keys(view: View | None) -> list[str]:
    """Per rank, where it runs: host name and IP (equal keys share a machine's network)."""
    if view is None:
        return []
    return [f"{m.host}/{host_of(m.address)}" for m in view.members]
