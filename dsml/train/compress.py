"""Compressed gradient averaging: casting, top-k and PowerSGD, with error feedback (train layer).

A `Compressor` replaces every gradient of a step, in place, by (an approximation of) its
mean over the ranks, and says how many bytes it moved. The gradients of a step travel
together: they are packed into one flat buffer, so a step is one collective (two for
PowerSGD), whatever the number of tensors.

| compressor | collectives per step | payload per rank (n elements, 4-byte floats) |
| --- | --- | --- |
| `NoCompression` | 1 all_reduce | 4n |
| `Cast("bfloat16")`, `Cast("float16")` | 1 all_reduce in that dtype | 2n |
| `TopK(ratio)` | 2 all_gathers (indices, values) | 8k, k = ceil(ratio * n) |
| `PowerSGD(rank)` | 2 all_reduces (P, then Q) | 4r(rows + cols) per matrix, 4n per vector |

Error feedback (top-k, PowerSGD): what a rank did not send this step is kept and added to
its next gradient, so over many steps nothing is lost: the sum of what a rank sent equals
the sum of its gradients minus what it still holds (`residual`).

Bytes: `payload_bytes` is what a rank hands to its collectives; `sent_bytes` estimates what
it puts on the wire with bandwidth-optimal algorithms (ring): 2(P-1)/P of the payload for
an all_reduce, (P-1) times it for an all_gather.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import ml_dtypes
import numpy as np

from ..communicator import Communicator
from ..errors import ConfigError

__all__ = [
    "COMPRESSIONS",
    "Cast",
    "Compressor",
    "NoCompression",
    "PowerSGD",
    "TopK",
    "Traffic",
    "compressor_from",
    "orthonormalize",
    "top_k",
]

COMPRESSIONS = ("none", "bf16", "fp16", "topk", "powersgd")


@dataclass
class Traffic:
    """Bytes a rank moved: handed to collectives (`payload_bytes`), sent on a ring
    (`sent_bytes`, an estimate), in how many collectives (`calls`)."""

    payload_bytes: int = 0
    sent_bytes: int = 0
    calls: int = 0

    def all_reduce(self, nbytes: int, world_size: int) -> None:
        self.payload_bytes += nbytes
        self.sent_bytes += 2 * (world_size - 1) * nbytes // max(world_size, 1)
        self.calls += 1

    def all_gather(self, nbytes: int, world_size: int) -> None:
        self.payload_bytes += nbytes
        self.sent_bytes += (world_size - 1) * nbytes
        self.calls += 1


class Compressor(Protocol):
    """Averages a step's gradients over the ranks, in place; counts the bytes in `traffic`."""

    traffic: Traffic

    async def average(self, comm: Communicator, grads: Mapping[str, np.ndarray]) -> None: ...


# -- packing: one flat buffer for a step's tensors ------------------------------------------


def _dtype_of(grads: Mapping[str, np.ndarray]) -> np.dtype:
    dtypes = {np.dtype(g.dtype) for g in grads.values()}
    if len(dtypes) != 1 or next(iter(dtypes)).kind != "f":
        raise ConfigError(
            f"gradients must share one floating dtype, got {sorted(map(str, dtypes))}"
        )
    return dtypes.pop()


def pack(grads: Mapping[str, np.ndarray]) -> np.ndarray:
    """Every tensor's elements, in mapping order, in one new flat array."""
    if not grads:
        return np.zeros(0, np.float32)
    return np.concatenate([np.asarray(g).reshape(-1) for g in grads.values()]).astype(
        _dtype_of(grads), copy=False
    )


def unpack(flat: np.ndarray, grads: Mapping[str, np.ndarray]) -> None:
    """Write flat's elements back into the tensors (the inverse of `pack`)."""
    offset = 0
    for g in grads.values():
        g[...] = flat[offset : offset + g.size].reshape(g.shape)
        offset += g.size
    assert offset == flat.size


# -- no compression and casting ---------------------------------------------------------------


@dataclass
class NoCompression:
    """One all_reduce(avg) of the packed gradients."""

    traffic: Traffic = field(default_factory=Traffic)

    async def average(self, comm: Communicator, grads: Mapping[str, np.ndarray]) -> None:
        flat = pack(grads)
        await comm.all_reduce(flat, op="avg")
        self.traffic.all_reduce(flat.nbytes, comm.world_size)
        unpack(flat, grads)


_CASTS = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}


@dataclass
class Cast:
    """Send the gradients in a 2-byte float (as torch DDP's fp16 and bf16 hooks): each
    rank divides by the world size first (so the sum cannot overflow float16), sums in
    the narrow dtype, and widens the result. About 3 significant digits survive."""

    dtype: str = "bfloat16"
    traffic: Traffic = field(default_factory=Traffic)

    def __post_init__(self) -> None:
        if self.dtype not in _CASTS:
            raise ConfigError(f"Cast dtype must be one of {', '.join(_CASTS)}, got {self.dtype!r}")

    async def average(self, comm: Communicator, grads: Mapping[str, np.ndarray]) -> None:
        flat = pack(grads)
        narrow = (flat / flat.dtype.type(comm.world_size)).astype(_CASTS[self.dtype])
        await comm.all_reduce(narrow, op="sum")
        self.traffic.all_reduce(narrow.nbytes, comm.world_size)
        unpack(narrow.astype(flat.dtype), grads)


# -- top-k with error feedback ---------------------------------------------------------------


def top_k(values: np.ndarray, k: int) -> np.ndarray:
    """Indices (int32, ascending) of the k entries of largest magnitude of a flat array."""
    if k >= values.size:
        return np.arange(values.size, dtype=np.int32)
    chosen = np.argpartition(np.abs(values), values.size - k)[values.size - k :]
    return np.sort(chosen).astype(np.int32)


@dataclass
class TopK:
    """Each rank sends only its k = ceil(ratio * n) largest entries (indices and values,
    all_gathered), the rest kept as its residual for the next step (error feedback)."""

    ratio: float = 0.01
    error_feedback: bool = True
    traffic: Traffic = field(default_factory=Traffic)
    residual: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not 0 < self.ratio <= 1:
            raise ConfigError(f"TopK ratio must be in (0, 1], got {self.ratio!r}")

    def select(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(indices, values) to send from this step's flat gradient; updates the residual."""
        if self.error_feedback:
            if self.residual is None:
                self.residual = np.zeros_like(flat)
            flat = flat + self.residual
        index = top_k(flat, max(1, math.ceil(self.ratio * flat.size)))
        values = flat[index]
        if self.error_feedback:
            flat[index] = 0
            self.residual = flat
        return index, values

    async def average(self, comm: Communicator, grads: Mapping[str, np.ndarray]) -> None:
        flat = pack(grads)
        index, values = self.select(flat)
        all_index = await comm.all_gather(index)
        all_values = await comm.all_gather(values)
        self.traffic.all_gather(index.nbytes, comm.world_size)
        self.traffic.all_gather(values.nbytes, comm.world_size)
        dense = np.zeros_like(flat)
        np.add.at(dense, all_index, all_values)  # ranks' indices overlap: add, not assign
        dense /= dense.dtype.type(comm.world_size)
        unpack(dense, grads)


# -- PowerSGD -------------------------------------------------------------------------------


def orthonormalize(p: np.ndarray) -> np.ndarray:
    """An orthonormal basis of p's columns (reduced QR; deterministic, so every rank that
    holds the same p gets the same result)."""
    q, _ = np.linalg.qr(p)
    return np.ascontiguousarray(q, dtype=p.dtype)


@dataclass
class PowerSGD:
    """Rank-r compression of every matrix (Vogels et al., 2019, as torch's PowerSGD hook):
    with M = grad + error (error feedback) and Q from the previous step (warm start),
    P = mean(M Q), orthonormalized; Q = mean(Mᵀ P); the step uses P Qᵀ and keeps
    M - P Qᵀ as the error. Tensors with fewer than 2 dimensions, or too small for rank r
    to save anything, go uncompressed in the first all_reduce."""

    rank: int = 4
    seed: int = 0
    traffic: Traffic = field(default_factory=Traffic)
    error: dict[str, np.ndarray] = field(default_factory=dict)
    q: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"PowerSGD rank must be an integer >= 1, got {self.rank!r}")

    def _compressed(self, grad: np.ndarray) -> bool:
        if grad.ndim < 2:
            return False
        rows, cols = grad.shape[0], grad.size // grad.shape[0]
        return bool(self.rank * (rows + cols) < rows * cols)

    def _matrix(self, key: str, grad: np.ndarray) -> np.ndarray:
        """M = grad + error as a (rows, cols) matrix; Q made on first use, the same on
        every rank (seeded by key position, not by rank)."""
        m = grad.reshape(grad.shape[0], -1).astype(grad.dtype, copy=True)
        m += self.error.get(key, 0)
        if key not in self.q:
            rng = np.random.default_rng([self.seed, len(self.q)])
            self.q[key] = rng.standard_normal((m.shape[1], self.rank)).astype(m.dtype)
        return m

    async def average(self, comm: Communicator, grads: Mapping[str, np.ndarray]) -> None:
        matrices = {k: self._matrix(k, g) for k, g in grads.items() if self._compressed(g)}
        plain = {k: g for k, g in grads.items() if k not in matrices}
        # phase 1: P = M Q for every matrix, with the uncompressed tensors, in one all_reduce
        ps = {k: m @ self.q[k] for k, m in matrices.items()}
        first = pack({**ps, **plain})
        await comm.all_reduce(first, op="avg")
        self.traffic.all_reduce(first.nbytes, comm.world_size)
        unpack(first, {**ps, **plain})
        # phase 2: Q = Mᵀ P with P orthonormalized (the same on every rank), averaged
        ps = {k: orthonormalize(p) for k, p in ps.items()}
        qs = {k: m.T @ ps[k] for k, m in matrices.items()}
        second = pack(qs)
        if matrices:
            await comm.all_reduce(second, op="avg")
            self.traffic.all_reduce(second.nbytes, comm.world_size)
            unpack(second, qs)
        for key, m in matrices.items():  # the rank-r approximation, and what it missed
            approx = ps[key] @ qs[key].T
            self.error[key] = m - approx
            self.q[key] = qs[key]
            grads[key][...] = approx.reshape(grads[key].shape)


def compressor_from(spec: str | None) -> Compressor:
    """A compressor from a short name: "none", "bf16", "fp16", "topk[:RATIO]" (0.01),
    "powersgd[:RANK]" (4)."""
    name, _, arg = (spec or "none").partition(":")
    try:
        if name == "none" and not arg:
            return NoCompression()
        if name in ("bf16", "fp16") and not arg:
            return Cast("bfloat16" if name == "bf16" else "float16")
        if name == "topk":
            return TopK(float(arg) if arg else 0.01)
        if name == "powersgd":
            return PowerSGD(int(arg) if arg else 4)
    except ValueError as exc:
        raise ConfigError(f"compression {spec!r}: {exc}") from None
    raise ConfigError(
        f"compression must be one of none, bf16, fp16, topk[:RATIO], powersgd[:RANK]; got {spec!r}"
    )
