"""Reduce ops and supported dtypes (collectives layer).

Every rank validates its own arguments with these functions before anything is sent, so
bad input fails locally with a `ConfigError` that says what to do.
"""

from __future__ import annotations

import enum
from typing import Any

import ml_dtypes
import numpy as np

from ..errors import ConfigError

__all__ = ["DTYPES", "UFUNCS", "ReduceOp", "check_op", "dtype_name", "is_floating"]


class ReduceOp(enum.StrEnum):
    """Reduction operators; plain strings ("sum", ...) are accepted wherever one is."""

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    BAND = "band"  # bitwise, for integer and bool dtypes (torch's ReduceOp.BAND/BOR/BXOR)
    BOR = "bor"
    BXOR = "bxor"


#: The numpy ufunc that combines two operands for each op (`avg` sums, then divides).
UFUNCS: dict[ReduceOp, Any] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}

#: Wire name -> numpy dtype of every dtype the collectives accept.
DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(t)
    for name, t in [
        ("bool", np.bool_),
        ("int8", np.int8),
        ("int16", np.int16),
        ("int32", np.int32),
        ("int64", np.int64),
        ("uint8", np.uint8),
        ("uint16", np.uint16),
        ("uint32", np.uint32),
        ("uint64", np.uint64),
        ("float16", np.float16),
        ("float32", np.float32),
        ("float64", np.float64),
        ("bfloat16", ml_dtypes.bfloat16),
        ("complex64", np.complex64),
        ("complex128", np.complex128),
    ]
}

_FLOATING = {"float16", "float32", "float64", "bfloat16", "complex64", "complex128"}
_COMPLEX = {"complex64", "complex128"}
_BITWISE = {ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR}
_BY_DTYPE = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: Any) -> str:
    """Wire name of a supported dtype (any byte order); ConfigError otherwise."""
    native = np.dtype(dtype).newbyteorder("=")
    name = _BY_DTYPE.get(native)
    if name is None:
        supported = ", ".join(DTYPES)
        raise ConfigError(f"dtype {np.dtype(dtype)} is not supported; use one of: {supported}")
    return name


def is_floating(name: str) -> bool:
    return name in _FLOATING


def check_op(op: Any, dtype: str) -> ReduceOp:
    """Validate op for a dtype wire name and return it as a ReduceOp."""
    try:
        reduce_op = ReduceOp(op)
    except ValueError:
        choices = ", ".join(repr(o.value) for o in ReduceOp)
        raise ConfigError(f"unknown reduce op {op!r}; use one of {choices}") from None
    if reduce_op is ReduceOp.AVG and dtype not in _FLOATING:
        raise ConfigError(
            f"op='avg' needs a floating dtype, got {dtype}; use op='sum' and divide, "
            "or cast to float32 first"
        )
    if reduce_op in _BITWISE and dtype in _FLOATING:
        raise ConfigError(
            f"op={reduce_op.value!r} is bitwise: it needs an integer or bool dtype, got {dtype}"
        )
    if reduce_op in (ReduceOp.MIN, ReduceOp.MAX) and dtype in _COMPLEX:
        raise ConfigError(f"op={reduce_op.value!r} is not defined for {dtype}; use sum or prod")
    return reduce_op
