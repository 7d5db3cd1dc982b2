"""What `algorithm="auto"` runs: the measured model of the current view (collectives layer).

One `AutoChooser` per communicator. The first `auto` all-reduce of each view carries the
probe (cost_probe.py): its ranks measure the links and agree on rank 0's model before they
run the algorithm that model picks, all inside that one call. Later `auto` calls of the
view wait for that model (normally long there) and choose from it. So the view's model is
measured once, by the same call on every rank, and a new view measures again.

Which call probes is decided when the call is made (`ticket`, in program order, which is
the same on every rank), never by timing. If the probe fails (its call failed), the view
falls back to the size table of select.py, on every rank alike.

A group on a single host does not probe: the model would keep that host's size table
anyway (see cost.py), so such groups pay nothing. Nor does a communicator whose frames
are capped below the probe's largest message (`CommConfig.max_frame_bytes`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from .cost import HIERARCHICAL, MODELLED, Choice, CostModel
from .cost_probe import PROBE_FRAME_BYTES, WithChunk, measure_cost
from .group import Group
from .select import choose_all_reduce

__all__ = ["AutoChooser", "AutoTicket", "WithChunk"]

_REMEMBERED = 1024  # sizes whose choice is kept (a program uses a few)

#: The current view's epoch, and the host key of each of its ranks.
Epoch = Callable[[], int]
Hosts = Callable[[], Sequence[str]]


class AutoTicket:
    """One `auto` call's right to the view's model: `resolve` says what to run."""

    def __init__(self, chooser: AutoChooser, epoch: int, probes: bool, hosts: Sequence[str]):
        self._chooser, self._epoch, self._probes, self._hosts = chooser, epoch, probes, hosts

    async def resolve(
        self, group: Group, nbytes: int, hierarchical: bool = False
    ) -> tuple[Group, str]:
        """(the group to run on, with the chosen chunk; the chosen algorithm), weighing
        `hierarchical` too when the caller can run it (it must say so alike on every rank)."""
        model = await self._chooser._model_for(self._epoch, self._probes, group, self._hosts)
        if model is None:
            return group, choose_all_reduce(nbytes, group.size)
        choice = self._chooser.choose(model, nbytes, hierarchical)
        self._chooser.chosen = (nbytes, choice)
        return WithChunk(group, choice.chunk_bytes), choice.algorithm


class AutoChooser:
    """The cost model of the current view and the choices `auto` makes from it."""

    def __init__(
        self,
        epoch: Epoch,
        hosts: Hosts,
        *,
        default_chunk_bytes: int,
        max_chunk_bytes: int,
        frame_limit: Callable[[], int] | None = None,
    ):
        """`max_chunk_bytes` bounds the chunks it chooses; `frame_limit()`, read once per
        view, lowers that bound to the smallest frame a member of the view accepts (the
        same on every rank: it comes from the view)."""
        self._current_epoch, self._current_hosts = epoch, hosts
        self._max_chunk_bytes, self._frame_limit = max_chunk_bytes, frame_limit
        self._seen: tuple[int, list[str], bool] = (-1, [], False)  # epoch, hosts, one host
        self._chunks = {
            "default_chunk_bytes": default_chunk_bytes,
            "max_chunk_bytes": max_chunk_bytes,
        }
        self._epoch = -1
        self._model: asyncio.Future[CostModel | None] | None = None
        #: the last choice made, (bytes, Choice): for `dsml bench` and logs
        self.chosen: tuple[int, Choice] | None = None
        # choices made from the current model, by size: evaluating every algorithm at
        # every chunk size costs more than a small all-reduce takes
        self._choices: tuple[CostModel | None, dict[tuple[int, bool], Choice]] = (None, {})

    def choose(self, model: CostModel, nbytes: int, hierarchical: bool = False) -> Choice:
        """model.choose(nbytes), with the hierarchical algorithm among the candidates if
        asked; remembered per size for as long as the model is current."""
        known, choices = self._choices
        if known is not model:
            choices = {}
            self._choices = (model, choices)
        choice = choices.get((nbytes, hierarchical))
        if choice is None:
            if len(choices) >= _REMEMBERED:
                choices.clear()
            candidates = (*MODELLED, HIERARCHICAL) if hierarchical else MODELLED
            choice = choices[nbytes, hierarchical] = model.choose(nbytes, candidates)
        return choice

    @property
    def model(self) -> CostModel | None:
        """The current view's measured model (None: single host, not measured yet, or failed)."""
        if self._model is None or not self._model.done() or self._model.cancelled():
            return None
        if self._model.exception() is not None:
            return None
        return self._model.result()

    def choice(self, nbytes: int, world_size: int, hierarchical: bool = False) -> Choice:
        """What `auto` runs at this size now (the size table until a model is known);
        `hierarchical`: whether auto weighs it in this view (as a call does)."""
        model = self.model
        if model is not None and model.world_size == world_size:
            return self.choose(model, nbytes, hierarchical)
        algo = choose_all_reduce(nbytes, world_size)
        return Choice(algo, int(self._chunks["default_chunk_bytes"]), float("nan"))

    def ticket(self) -> AutoTicket | None:
        """Register an `auto` call being made now (call in program order, after validation).

        None when the view is on a single host: the size table decides, at once.
        """
        epoch = self._current_epoch()
        if epoch != self._seen[0]:  # look at the view once per epoch: calls stay cheap
            hosts = list(self._current_hosts())
            self._seen = (epoch, hosts, len(set(hosts)) <= 1)
            limit = self._frame_limit() if self._frame_limit is not None else 0
            bound = min(self._max_chunk_bytes, limit) if limit > 0 else self._max_chunk_bytes
            self._chunks["max_chunk_bytes"] = bound
        _, hosts, one_host = self._seen
        if one_host or self._chunks["max_chunk_bytes"] < PROBE_FRAME_BYTES:
            return None  # the size table decides (frames this small cannot carry the probe)
        if epoch != self._epoch:  # the first auto call of this view: it measures
            self._epoch, self.chosen = epoch, None
            self._model = asyncio.get_running_loop().create_future()
            return AutoTicket(self, epoch, True, hosts)
        return AutoTicket(self, epoch, False, hosts)

    async def _model_for(
        self, epoch: int, probes: bool, group: Group, hosts: Sequence[str]
    ) -> CostModel | None:
        future = self._model
        if epoch != self._epoch or future is None:
            return None  # a newer view is being measured; this call is failing anyway
        if probes:
            try:
                future.set_result(await measure_cost(group, hosts, **self._chunks))
            except BaseException:
                future.set_result(None)  # the view falls back to the table (module doc)
                raise
        return await asyncio.shield(future)

    def __repr__(self) -> str:
        return f"<AutoChooser epoch={self._epoch} model={self.model!r}>"
