"""Optimizer updates a parameter server applies to its pieces (parameter-server layer, pure).

An optimizer is any object with `init_state(param)` (its per-piece state arrays) and
`apply(param, grad, state, step)` (update `param` in place; `step` counts this piece's
updates from 1). The built-ins are elementwise, so a key cut into pieces on several
servers is updated exactly as if it were whole. Scalars are cast to the parameter's dtype
first, so a float32 model stays float32 and matches `params -= lr * grads` bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..errors import ConfigError

__all__ = ["SGD", "Adam", "Momentum", "Optimizer"]

State = dict[str, np.ndarray]


class Optimizer(Protocol):
    """What a server calls: one state per piece, one `apply` per update."""

    def init_state(self, param: np.ndarray) -> State: ...

    def apply(self, param: np.ndarray, grad: np.ndarray, state: State, step: int) -> None: ...


def _check(name: str, value: float, low: float = 0.0, high: float = float("inf")) -> None:
    if not (isinstance(value, int | float) and low <= value < high):
        raise ConfigError(f"{name} must be a number in [{low:g}, {high:g}), got {value!r}")


@dataclass(frozen=True)
class SGD:
    """param -= lr * grad."""

    lr: float = 0.1

    def __post_init__(self) -> None:
        _check("lr", self.lr)

    def init_state(self, param: np.ndarray) -> State:
        return {}

    def apply(self, param: np.ndarray, grad: np.ndarray, state: State, step: int) -> None:
        param -= param.dtype.type(self.lr) * grad


@dataclass(frozen=True)
class Momentum:
    """Heavy-ball momentum as torch.optim.SGD has it: v = mu * v + grad, then
    param -= lr * v (or lr * (grad + mu * v) with `nesterov`)."""

    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False

    def __post_init__(self) -> None:
        _check("lr", self.lr)
        _check("momentum", self.momentum, 0.0, 1.0)

    def init_state(self, param: np.ndarray) -> State:
        return {"velocity": np.zeros_like(param)}

    def apply(self, param: np.ndarray, grad: np.ndarray, state: State, step: int) -> None:
        mu, lr = param.dtype.type(self.momentum), param.dtype.type(self.lr)
        v = state["velocity"]
        v *= mu
        v += grad
        param -= lr * (grad + mu * v if self.nesterov else v)


@dataclass(frozen=True)
class Adam:
    """Adam (Kingma and Ba) with bias correction, as torch.optim.Adam without weight decay."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self) -> None:
        _check("lr", self.lr)
        _check("beta1", self.beta1, 0.0, 1.0)
        _check("beta2", self.beta2, 0.0, 1.0)
        _check("eps", self.eps)

    def init_state(self, param: np.ndarray) -> State:
        return {"m": np.zeros_like(param), "v": np.zeros_like(param)}

    def apply(self, param: np.ndarray, grad: np.ndarray, state: State, step: int) -> None:
        t = param.dtype.type
        m, v = state["m"], state["v"]
        m *= t(self.beta1)
        m += t(1 - self.beta1) * grad
        v *= t(self.beta2)
        v += t(1 - self.beta2) * grad * grad
        m_hat = m / t(1 - self.beta1**step)
        v_hat = v / t(1 - self.beta2**step)
        param -= t(self.lr) * m_hat / (np.sqrt(v_hat) + t(self.eps))
