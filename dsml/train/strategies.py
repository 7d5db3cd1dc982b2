"""Data-parallel training strategies behind one interface: gradient averaging, local SGD,
DiLoCo (train layer).

Every rank holds the whole model as named arrays (`params`) and computes, each step, the
gradient of the mean loss over its own part of the data (`grads`, same names). Then

    await strategy.step(params, grads)

does the rest, whichever the strategy:

- `"grad"` (gradient averaging): each step, average the gradients (compressed or not),
  then the optimizer step: every rank takes the same step;
- `"local_sgd"` (weight averaging): each step, the optimizer step on the local gradient;
  every `period` steps, all_reduce(avg) of the parameters;
- `"diloco"`: local (inner) steps as local SGD; every `period` steps, average the
  pseudo-gradient (the parameters at the last sync minus now; compressed or not) and take
  one outer step of Nesterov momentum on it from the last sync's parameters.

`await strategy.finish(params)` averages what is left (local SGD and DiLoCo, when steps
were taken since the last sync), so every rank ends with the same parameters. With
`period=1` and plain SGD inside, local SGD takes the same steps as gradient averaging (up
to float rounding); DiLoCo with outer SGD(lr=1) and no momentum is local SGD.

Costs per rank and step, for n parameters of 4 bytes on P ranks (ring algorithms):
gradient averaging sends 8n(P-1)/P bytes each step; local SGD and DiLoCo the same every
`period` steps. The optimizers are those of `dsml.ps` (`SGD`, `Momentum`, `Adam`, or any
object with `init_state` and `apply`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._opener import Opener
from ..communicator import Communicator
from ..errors import ConfigError
from ..ps.optim import SGD, Momentum, Optimizer
from .compress import Compressor, NoCompression, Traffic, compressor_from

__all__ = [
    "STRATEGIES",
    "DiLoCo",
    "GradientAveraging",
    "LocalSGD",
    "Strategy",
    "StrategyConfig",
    "open_strategy",
]

STRATEGIES = ("grad", "local_sgd", "diloco")
Params = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class StrategyConfig:
    """How a strategy trains (see the module docstring).

    Args:
        strategy: "grad", "local_sgd" or "diloco".
        optimizer: the step every rank takes on its gradient (inner optimizer for DiLoCo).
        period: steps between averages (local SGD, DiLoCo); 1 for gradient averaging.
        compression: what "grad" and "diloco" average with: "none", "bf16", "fp16",
            "topk[:RATIO]", "powersgd[:RANK]" (see `dsml.train.compress`).
        outer_lr: DiLoCo's outer step size (the paper's 0.7).
        outer_momentum: DiLoCo's outer Nesterov momentum (the paper's 0.9).
    """

    strategy: str = "grad"
    optimizer: Optimizer = field(default_factory=SGD)
    period: int = 1
    compression: str = "none"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(
                f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}"
            )
        if not isinstance(self.period, int) or self.period < 1:
            raise ConfigError(f"period must be an integer >= 1, got {self.period!r}")
        if self.strategy == "grad" and self.period != 1:
            raise ConfigError(
                "period applies to local_sgd and diloco; gradient averaging averages every step"
            )
        if self.strategy == "local_sgd" and self.compression != "none":
            raise ConfigError(
                "local_sgd averages the parameters themselves, uncompressed; to compress "
                "weight averaging use strategy='diloco' (it averages pseudo-gradients)"
            )
        compressor_from(self.compression)  # raises ConfigError for a bad name
        Momentum(self.outer_lr, self.outer_momentum)  # validates both


class Strategy:
    """What a training loop calls, whichever the strategy: `step`, `finish`, `stats`.

    The base holds the optimizer step each rank takes on its own arrays and the counts.
    """

    def __init__(self, comm: Communicator, optimizer: Optimizer) -> None:
        self.comm, self.optimizer = comm, optimizer
        self.steps = self.syncs = 0
        self._state: dict[str, dict[str, np.ndarray]] = {}
        self.traffic = Traffic()

    async def step(self, params: Params, grads: Params) -> None:
        """One training step from this rank's gradients (see the subclasses)."""
        raise NotImplementedError

    async def finish(self, params: Params) -> None:
        """Make every rank's parameters equal at the end (see the subclasses)."""
        raise NotImplementedError

    def _apply(self, params: Params, grads: Params) -> None:
        self.steps += 1
        for key, param in params.items():
            if key not in self._state:
                self._state[key] = self.optimizer.init_state(param)
            self.optimizer.apply(param, grads[key], self._state[key], self.steps)

    def stats(self) -> dict[str, Any]:
        """Steps taken, averages made, bytes moved (see `Traffic`)."""
        t = self.traffic
        return {
            "steps": self.steps,
            "syncs": self.syncs,
            "payload_bytes": t.payload_bytes,
            "sent_bytes": t.sent_bytes,
            "calls": t.calls,
        }

    async def aclose(self) -> None:
        """Nothing to release: a strategy holds arrays, no sockets or tasks."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} steps={self.steps} syncs={self.syncs} {self.traffic}>"


class GradientAveraging(Strategy):
    """Average the gradients every step (compressed or not), then the optimizer step."""

    def __init__(self, comm: Communicator, optimizer: Optimizer, compressor: Compressor) -> None:
        super().__init__(comm, optimizer)
        self.compressor = compressor
        self.traffic = compressor.traffic

    async def step(self, params: Params, grads: Params) -> None:
        """Average `grads` over the ranks in place, then update `params` with them."""
        await self.compressor.average(self.comm, grads)
        self.syncs += 1
        self._apply(params, grads)

    async def finish(self, params: Params) -> None:
        """Nothing is left to average: every step was."""


class LocalSGD(Strategy):
    """Local optimizer steps; every `period` steps the parameters are averaged."""

    def __init__(self, comm: Communicator, optimizer: Optimizer, period: int) -> None:
        super().__init__(comm, optimizer)
        self.period = period
        self._since_sync = 0

    async def step(self, params: Params, grads: Params) -> None:
        """A local step; the average when `period` steps have passed since the last."""
        self._apply(params, grads)
        self._since_sync += 1
        if self._since_sync == self.period:
            await self.sync(params)

    async def sync(self, params: Params) -> None:
        """Replace every rank's parameters by their mean over the ranks."""
        await NoCompression(self.traffic).average(self.comm, params)
        self.syncs += 1
        self._since_sync = 0

    async def finish(self, params: Params) -> None:
        """Average the steps taken since the last sync, if any."""
        if self._since_sync:
            await self.sync(params)


class DiLoCo(LocalSGD):
    """Local SGD whose averages go through an outer optimizer (Douillard et al., 2023):
    at each sync, the pseudo-gradient (parameters at the last sync minus now) is averaged
    and the outer Nesterov momentum steps from the last sync's parameters."""

    def __init__(
        self,
        comm: Communicator,
        optimizer: Optimizer,
        period: int,
        compressor: Compressor,
        outer: Optimizer,
        params: Params,
    ) -> None:
        super().__init__(comm, optimizer, period)
        self.compressor, self.outer = compressor, outer
        self.traffic = compressor.traffic
        self._anchor = {k: np.array(v, copy=True) for k, v in params.items()}
        self._outer_state = {k: outer.init_state(v) for k, v in self._anchor.items()}

    async def sync(self, params: Params) -> None:
        """The outer step: average the pseudo-gradient, move the anchor, copy it."""
        delta = {k: self._anchor[k] - params[k] for k in params}
        await self.compressor.average(self.comm, delta)
        self.syncs += 1
        self._since_sync = 0
        for key, anchor in self._anchor.items():
            self.outer.apply(anchor, delta[key], self._outer_state[key], self.syncs)
            params[key][...] = anchor


def make_strategy(comm: Communicator, params: Params, config: StrategyConfig) -> Strategy:
    """The strategy `config` names, for parameters that every rank already holds equal."""
    compressor = compressor_from(config.compression)
    if config.strategy == "grad":
        return GradientAveraging(comm, config.optimizer, compressor)
    if config.strategy == "local_sgd":
        return LocalSGD(comm, config.optimizer, config.period)
    outer = Momentum(config.outer_lr, config.outer_momentum, nesterov=True)
    return DiLoCo(comm, config.optimizer, config.period, compressor, outer, params)


def open_strategy(
    comm: Communicator, params: Params, config: StrategyConfig | None = None, **options: Any
) -> Opener[Strategy]:
    """Start a strategy on every rank of `comm` (a collective: all ranks call it).

    Rank 0's `params` are broadcast into every rank's arrays first, so all start equal;
    `config` (or its fields as keywords) says which strategy. `async with` gives the
    strategy; so does `await`.
    """
    config = config or StrategyConfig(**options)

    async def start() -> Strategy:
        await asyncio.gather(*(comm.broadcast(v, root=0) for v in params.values()))
        return make_strategy(comm, params, config)

    return Opener(start, name="dsml.train.open_strategy")
