"""What one server holds and decides: values, clocks, pending steps (parameter-server layer, pure).

No I/O here: `ShardState.handle(worker, request)` applies a request and returns the
replies that became ready (to any worker), so the rules can be tested without sockets.

Clocks: a worker's clock for a piece is the number of its pushes of that piece the server
has taken. A pull from a worker whose clock for the piece is c is

- `bsp`: answered when step c-1 of the piece is applied, i.e. every worker's c-th push
  is in; the pushes of a step are summed in worker order, then one optimizer update.
- `ssp`: answered when the slowest worker's clock is at least c - staleness; pushes are
  applied on arrival.
- `async`: answered at once; pushes are applied on arrival (Downpour).

A `DONE` request is answered once every worker is done. Workers that are done or lost no
longer hold anyone back: the slowest clock and a BSP step count only the others (a lost
worker's gradients for steps not applied yet are dropped; its applied ones stay).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from ..errors import ProtocolError
from .layout import Layout, Piece
from .messages import DONE, Request
from .optim import Optimizer

__all__ = ["CONSISTENCY", "Outgoing", "ShardState"]

CONSISTENCY = ("bsp", "ssp", "async")


@dataclass
class _PieceState:
    value: np.ndarray  # flat; this server's copy of elements [lo, hi) of the key
    opt_state: dict[str, np.ndarray]
    updates: int = 0  # optimizer steps applied (Adam's t)
    applied: int = 0  # BSP steps applied
    contributors: list[tuple[int, ...]] = field(default_factory=list)  # per BSP step: whose
    pending: dict[int, dict[int, np.ndarray]] = field(
        default_factory=dict
    )  # step -> worker -> grad


@dataclass
class _Pull:
    worker: int
    seq: int
    kind: int
    pieces: tuple[Piece, ...]
    clocks: tuple[int, ...]  # the worker's clock for each piece when it asked


@dataclass(frozen=True)
class Outgoing:
    """A reply that is ready: to `worker`, for its request `seq`, with these values."""

    worker: int
    seq: int
    values: tuple[tuple[Piece, np.ndarray], ...]
    final: bool  # the answer to DONE: the last message to this worker


class ShardState:
    """One server's pieces, the workers' clocks, and the pulls waiting to be answered."""

    def __init__(
        self,
        layout: Layout,
        server: int,
        initial: Mapping[str, np.ndarray],
        optimizer: Optimizer,
        workers: Iterable[int],
        consistency: str = "bsp",
        staleness: int = 0,
    ) -> None:
        assert consistency in CONSISTENCY
        self.consistency, self.staleness, self.optimizer = consistency, staleness, optimizer
        self.pieces: dict[int, _PieceState] = {}
        for piece in layout.on_server(server):
            flat = np.array(initial[piece.key], dtype=piece.dtype).reshape(-1)[piece.lo : piece.hi]
            self.pieces[piece.index] = _PieceState(flat.copy(), optimizer.init_state(flat))
        self.live = set(workers)  # neither lost nor done
        self.done: set[int] = set()
        self.clocks: dict[int, defaultdict[int, int]] = {w: defaultdict(int) for w in self.live}
        self.last_seq = dict.fromkeys(self.live, 0)
        self.waiting: list[_Pull] = []
        self.max_lead = 0  # SSP instrumentation: the largest clock lead a reply allowed

    # -- requests -------------------------------------------------------------------------

    def handle(self, worker: int, request: Request) -> list[Outgoing]:
        """Take a request (a re-sent one's pushes are not applied twice); the ready replies."""
        if worker not in self.last_seq:
            raise ProtocolError(f"worker {worker} is not a worker of this server")
        if request.seq > self.last_seq[worker] + 1:
            raise ProtocolError(f"worker {worker} skipped requests before #{request.seq}")
        if request.seq == self.last_seq[worker] + 1:
            self.last_seq[worker] = request.seq
            for piece, grad in request.push:
                self._take_push(worker, piece, grad)
            if request.kind == DONE:
                self.live.discard(worker)
                self.done.add(worker)
                self._apply_ready_steps()
        clocks = tuple(self.clocks[worker][p.index] for p in request.pull)
        self.waiting.append(_Pull(worker, request.seq, request.kind, request.pull, clocks))
        return self._ready()

    def drop(self, worker: int) -> list[Outgoing]:
        """A worker was lost: stop waiting for it; the replies that became ready."""
        if worker in self.live:
            self.live.discard(worker)
            for state in self.pieces.values():
                for grads in state.pending.values():
                    grads.pop(worker, None)
            self._apply_ready_steps()
        self.waiting = [p for p in self.waiting if p.worker != worker]
        return self._ready()

    def ready(self) -> list[Outgoing]:
        """The waiting pulls that can be answered now (a backup taking over answers them;
        workers ignore an answer to a request they no longer wait for)."""
        return self._ready()

    @property
    def finished(self) -> bool:
        """Every worker is done or lost."""
        return not self.live

    # -- pushes ---------------------------------------------------------------------------

    def _take_push(self, worker: int, piece: Piece, grad: np.ndarray) -> None:
        state = self.pieces[piece.index]
        step = self.clocks[worker][piece.index]
        self.clocks[worker][piece.index] = step + 1
        if self.consistency != "bsp":
            self._update(state, grad)
            return
        state.pending.setdefault(step, {})[worker] = grad
        self._apply_ready_steps(piece.index)

    def _apply_ready_steps(self, only: int | None = None) -> None:
        """Apply every BSP step whose expected pushes are all in, in step order."""
        indices = self.pieces if only is None else [only]
        for index in indices:
            state = self.pieces[index]
            while (grads := state.pending.get(state.applied)) is not None:
                if not self.live <= grads.keys():
                    break
                total = np.array(grads[min(grads)], copy=True)
                for worker in sorted(grads)[1:]:  # a fixed order: the same sum every run
                    total += grads[worker]
                del state.pending[state.applied]
                state.applied += 1
                state.contributors.append(tuple(sorted(grads)))  # for replays: who was summed
                self._update(state, total)

    def _update(self, state: _PieceState, grad: np.ndarray) -> None:
        state.updates += 1
        self.optimizer.apply(state.value, grad, state.opt_state, state.updates)

    # -- pulls ----------------------------------------------------------------------------

    def _slowest(self, index: int) -> int | None:
        return min((self.clocks[w][index] for w in self.live), default=None)

    def _can_answer(self, pull: _Pull) -> bool:
        if pull.kind == DONE:
            return not self.live
        for piece, clock in zip(pull.pieces, pull.clocks, strict=True):
            if self.consistency == "bsp" and self.pieces[piece.index].applied < clock:
                return False
            slowest = self._slowest(piece.index)
            if (
                self.consistency == "ssp"
                and slowest is not None
                and slowest < clock - self.staleness
            ):
                return False
        return True

    def _ready(self) -> list[Outgoing]:
        out, still = [], []
        for pull in self.waiting:
            if not self._can_answer(pull):
                still.append(pull)
                continue
            self._note_lead(pull)
            values = tuple((p, self.pieces[p.index].value.copy()) for p in pull.pieces)
            out.append(Outgoing(pull.worker, pull.seq, values, pull.kind == DONE))
        self.waiting = still
        return out

    def _note_lead(self, pull: _Pull) -> None:
        for piece, clock in zip(pull.pieces, pull.clocks, strict=True):
            slowest = self._slowest(piece.index)
            if slowest is not None:
                lead = clock - slowest
                self.max_lead = max(self.max_lead, lead)

    def __repr__(self) -> str:
        return (
            f"ShardState({self.consistency}, pieces={len(self.pieces)}, live={sorted(self.live)}, "
            f"done={sorted(self.done)}, waiting={len(self.waiting)})"
        )
