"""Device names, telling cupy arrays apart, and loading cupy lazily (collectives layer).

cupy is optional (the `gpu` extra) and heavy to import, so nothing here imports it at
module level: a cupy array is recognised by its type's module name, and `load_cupy` imports
cupy only when a cupy array is seen or a CUDA device is asked for. Whichever cupy wheel is
installed (`cupy-cuda12x`, `cupy-cuda13x`) is used; they all install the `cupy` module.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

__all__ = [
    "CUPY_HINT",
    "DeviceSpec",
    "cuda_device_count",
    "is_cupy_array",
    "load_cupy",
    "parse_device",
    "resolve_device",
]

CUPY_HINT = 'pip install "dsml[gpu]" (cupy-cuda12x; with CUDA 13 pip install cupy-cuda13x)'

_DEVICE = re.compile(r"(cpu|cuda)(?::(\d{1,4}))?")


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """A parsed device name: "cpu", "cuda" (index chosen by local rank) or "cuda:N"."""

    kind: str
    index: int | None = None

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"


def parse_device(text: object) -> DeviceSpec:
    """Parse "cpu", "cuda" or "cuda:N" (None means "cpu"); ConfigError otherwise."""
    if text is None:
        return DeviceSpec("cpu")
    match = _DEVICE.fullmatch(text.strip().lower()) if isinstance(text, str) else None
    if match is None or (match.group(1) == "cpu" and match.group(2) is not None):
        raise ConfigError(f"device={text!r} is not a device name; use 'cpu', 'cuda' or 'cuda:N'")
    index = match.group(2)
    return DeviceSpec(match.group(1), None if index is None else int(index))


def is_cupy_array(x: object) -> bool:
    """True for a cupy.ndarray, decided without importing cupy."""
    kind = type(x)
    return kind.__name__ == "ndarray" and kind.__module__.split(".")[0] == "cupy"


def load_cupy() -> Any:
    """The cupy module; ConfigError saying how to install it when it is missing or broken."""
    try:
        return importlib.import_module("cupy")
    except ImportError as exc:
        raise ConfigError(
            f"a CUDA device needs cupy, which could not be imported ({exc}): {CUPY_HINT}"
        ) from exc


def cuda_device_count(cupy: Any) -> int:
    """GPUs this process can see (0 without a driver or a device)."""
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # CUDARuntimeError without a driver: no usable GPU either way
        return 0


def resolve_device(spec: DeviceSpec, local_rank: int | None) -> str:
    """The concrete device: "cpu" or "cuda:N", checking that CUDA and that GPU exist.

    "cuda" without an index takes GPU `local_rank % count`, as torchrun users expect
    (rank 0 when the local rank is unknown).

    Raises:
        ConfigError: cupy is not installed, no GPU is visible, or the index is too large.
    """
    if not spec.is_cuda:
        return "cpu"
    count = cuda_device_count(load_cupy())
    if count == 0:
        raise ConfigError(
            f"device={str(spec)!r} was asked for, but no CUDA GPU is visible to this process "
            "(no driver, no device, or CUDA_VISIBLE_DEVICES hides them); use device='cpu'"
        )
    index = spec.index if spec.index is not None else (local_rank or 0) % count
    if index >= count:
        raise ConfigError(
            f"device='cuda:{index}' does not exist: this process sees {count} GPU(s), "
            f"cuda:0..cuda:{count - 1}"
        )
    return f"cuda:{index}"
