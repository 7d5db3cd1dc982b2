"""Inputs with exact answers, and numpy references for every op (test helpers)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

DTYPE_NAMES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "bfloat16",
    "complex64",
    "complex128",
]
FLOATING = {"float16", "float32", "float64", "bfloat16", "complex64", "complex128"}
COMPLEX = {"complex64", "complex128"}
OPS = ["sum", "prod", "min", "max", "avg", "band", "bor", "bxor"]
BITWISE = {"band", "bor", "bxor"}

_UFUNC = {
    "sum": np.add,
    "avg": np.add,
    "prod": np.multiply,
    "min": np.minimum,
    "max": np.maximum,
    "band": np.bitwise_and,
    "bor": np.bitwise_or,
    "bxor": np.bitwise_xor,
}


def dtype(name: str) -> np.dtype[Any]:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def valid(op: str, name: str) -> bool:
    if op == "avg":
        return name in FLOATING
    if op in BITWISE:
        return name not in FLOATING
    if op in ("min", "max"):
        return name not in COMPLEX
    return True


def inputs(name: str, op: str, count: int, world_size: int, seed: int) -> list[np.ndarray]:
    """One array per rank, integer-valued so every summation order gives the same answer.

    Values stay small enough that sums and products of world_size of them are exact in
    every dtype (bfloat16 holds integers exactly up to 256).
    """
    rng = np.random.default_rng(seed)
    arrays = []
    for _ in range(world_size):
        if name == "bool":
            raw = rng.integers(0, 2, count)
        elif op == "prod":
            raw = rng.choice([1, 2] if name.startswith(("uint", "bool")) else [-1, 1, 2], count)
        else:
            low = 0 if name.startswith("uint") else -8
            raw = rng.integers(low, 9, count)
        arr = raw.astype(dtype(name))
        if name in COMPLEX:
            arr = arr + 1j * rng.integers(-4, 5, count).astype(dtype(name))
        arrays.append(arr)
    return arrays


def reduce_reference(op: str, arrays: list[np.ndarray]) -> np.ndarray:
    acc = arrays[0].copy()
    for arr in arrays[1:]:
        _UFUNC[op](acc, arr, out=acc)
    if op == "avg":
        np.divide(acc, len(arrays), out=acc, casting="unsafe")
    return acc


def same_bytes(results: list[np.ndarray]) -> bool:
    first = results[0]
    return all(
        r.dtype == first.dtype and r.shape == first.shape and r.tobytes() == first.tobytes()
        for r in results
    )
