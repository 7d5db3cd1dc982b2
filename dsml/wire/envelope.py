"""The envelope that starts every dsml message, and its codec (wire layer).

A message is a list of ZeroMQ frames: one msgpack-encoded envelope, then zero or more raw
payload frames. The envelope is a msgpack array

    [version, kind, epoch, src, cid, step, chunk, fingerprint | nil, body | nil]

where `fingerprint` describes the collective the sender is in (see `Fingerprint`) and `body`
is a small map of kind-specific fields. `decode` accepts untrusted bytes: it enforces size
limits, rejects foreign versions and unexpected types, and raises nothing but
`ProtocolError`. No pickle anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack

from ..errors import ProtocolError
from .kinds import Kind

__all__ = [
    "MAX_ENVELOPE_BYTES",
    "PROTOCOL_VERSION",
    "ROW_COLLECTIVES",
    "Envelope",
    "Fingerprint",
    "decode",
    "encode",
]

PROTOCOL_VERSION = 1
MAX_ENVELOPE_BYTES = 64 * 1024
_INT64_MAX = (1 << 63) - 1
_MAX_DIMS = 64
_MAX_NAME = 64
_KINDS = {int(kind): kind for kind in Kind}


#: Collectives whose first axis may differ between ranks: their fingerprint's `shape`
#: is the shape of one row (the array's shape without its first axis).
ROW_COLLECTIVES = frozenset({"all_gather", "gather", "all_to_all"})


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What a rank believes the current collective is; `None` fields are unknown to it.

    Two ranks agree when every field known to both is equal. A non-root of `scatter`, for
    example, knows neither dtype nor shape, and `all_gather` leaves the first axis open
    (see `ROW_COLLECTIVES`).
    """

    collective: str
    dtype: str | None = None
    count: int | None = None
    shape: tuple[int, ...] | None = None
    op: str | None = None
    root: int | None = None
    algorithm: str | None = None
    chunk_bytes: int | None = None  # pipeline chunk: both sides must cut messages alike

    def conflicts(self, other: Fingerprint) -> list[str]:
        """Names of the fields that both know and that differ."""
        if other is self or other == self:
            return []
        names = ("collective", "dtype", "count", "shape", "op", "root", "algorithm", "chunk_bytes")
        return [
            name
            for name in names
            if (mine := getattr(self, name)) is not None
            and (theirs := getattr(other, name)) is not None
            and mine != theirs
        ]

    def describe(self) -> str:
        """Human form, e.g. `all_reduce(float32, shape=(8,), op=sum, algorithm=ring)`."""
        parts = [self.dtype] if self.dtype else []
        if self.shape is not None and self.collective in ROW_COLLECTIVES:
            parts.append(f"shape=(*{''.join(', ' + str(d) for d in self.shape)})")
        elif self.shape is not None:
            parts.append(f"shape={self.shape}")
        elif self.count is not None:
            parts.append(f"count={self.count}")
        for name in ("op", "root", "algorithm"):
            value = getattr(self, name)
            if value is not None:
                parts.append(f"{name}={value}")
        return f"{self.collective}({', '.join(parts)})"

    def to_wire(self) -> list[Any]:
        return [
            self.collective,
            self.dtype,
            self.count,
            list(self.shape) if self.shape is not None else None,
            self.op,
            self.root,
            self.algorithm,
            self.chunk_bytes,
        ]

    @classmethod
    def from_wire(cls, raw: Any) -> Fingerprint:
        """Validate an untrusted wire fingerprint (cached: peers repeat the same few)."""
        if isinstance(raw, list) and len(raw) == 8 and isinstance(raw[3], list | None):
            # Types are part of the key: True == 1 and 1.0 == 1 must not hit a valid entry.
            shape = tuple((type(d), d) for d in raw[3]) if raw[3] is not None else None
            key = (*((type(v), v) for v in raw[:3]), shape, *((type(v), v) for v in raw[4:]))
            try:
                return _cached_fingerprint(key, raw)
            except TypeError:
                pass  # unhashable parts: not a valid fingerprint; let the checks say why
        return _check_fingerprint(raw)


def _check_fingerprint(raw: Any) -> Fingerprint:
    if not isinstance(raw, list | tuple) or len(raw) != 8:
        raise ProtocolError("fingerprint must be an array of 8 items")
    collective, dtype, count, shape, op, root, algorithm, chunk_bytes = raw
    _check_name(collective, "fingerprint.collective", optional=False)
    _check_name(dtype, "fingerprint.dtype")
    _check_name(op, "fingerprint.op")
    _check_name(algorithm, "fingerprint.algorithm")
    _check_int(count, "fingerprint.count", optional=True)
    _check_int(root, "fingerprint.root", optional=True)
    _check_int(chunk_bytes, "fingerprint.chunk_bytes", optional=True)
    if shape is not None:
        if not isinstance(shape, list | tuple) or len(shape) > _MAX_DIMS:
            raise ProtocolError("fingerprint.shape must be an array of at most 64 integers")
        for dim in shape:
            _check_int(dim, "fingerprint.shape")
        shape = tuple(shape)
    return Fingerprint(collective, dtype, count, shape, op, root, algorithm, chunk_bytes)


def _cached_fingerprint(key: tuple[Any, ...], raw: list[Any]) -> Fingerprint:
    fingerprint = _FINGERPRINTS.get(key)
    if fingerprint is None:
        fingerprint = _check_fingerprint(raw)
        if len(_FINGERPRINTS) >= 1024:
            _FINGERPRINTS.clear()
        _FINGERPRINTS[key] = fingerprint
    return fingerprint


_FINGERPRINTS: dict[tuple[Any, ...], Fingerprint] = {}


class Envelope(NamedTuple):
    """Header of one message; payload frames travel beside it, not inside."""

    kind: Kind
    epoch: int = 0
    src: int = -1
    cid: int = 0
    step: int = 0
    chunk: int = 0
    fingerprint: Fingerprint | None = None
    body: dict[str, Any] | None = None


def _check_int(value: Any, what: str, *, optional: bool = False, lo: int = 0) -> None:
    if value is None and optional:
        return
    if type(value) is not int or not lo <= value <= _INT64_MAX:
        raise ProtocolError(f"{what} must be an integer in [{lo}, 2**63)")


def _check_name(value: Any, what: str, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if type(value) is not str or not 0 < len(value) <= _MAX_NAME:
        raise ProtocolError(f"{what} must be a short string")


def encode(env: Envelope) -> bytes:
    """Serialise an envelope (trusted input: our own messages)."""
    fp = env.fingerprint.to_wire() if env.fingerprint is not None else None
    return msgpack.packb(  # type: ignore[no-any-return]
        [
            PROTOCOL_VERSION,
            int(env.kind),
            env.epoch,
            env.src,
            env.cid,
            env.step,
            env.chunk,
            fp,
            env.body,
        ],
        use_bin_type=True,
    )


def _unpack(data: bytes | memoryview, max_bytes: int) -> Any:
    if len(data) > max_bytes:
        raise ProtocolError(f"envelope of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=65536,
            max_map_len=1024,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types on garbage; all mean "malformed"
        raise ProtocolError(f"envelope is not valid msgpack: {type(exc).__name__}") from None


def decode(data: bytes | memoryview, *, max_bytes: int = MAX_ENVELOPE_BYTES) -> Envelope:
    """Parse untrusted envelope bytes.

    Raises:
        ProtocolError: for anything but a well-formed envelope of this protocol version.
    """
    raw = _unpack(data, max_bytes)
    if not isinstance(raw, list) or len(raw) != 9:
        raise ProtocolError("envelope must be a msgpack array of 9 items")
    version, kind, epoch, src, cid, step, chunk, fp, body = raw
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise ProtocolError(f"protocol version {version!r} is not {PROTOCOL_VERSION}")
    kind = _KINDS.get(kind) if type(kind) is int else None
    if kind is None:
        raise ProtocolError(f"unknown message kind {raw[1]!r}")
    _check_int(epoch, "epoch")
    _check_int(src, "src", lo=-1)
    for value, what in ((cid, "cid"), (step, "step"), (chunk, "chunk")):
        _check_int(value, what)
    if body is not None and not isinstance(body, dict):
        raise ProtocolError("envelope body must be a map")
    fingerprint = Fingerprint.from_wire(fp) if fp is not None else None
    return Envelope(kind, epoch, src, cid, step, chunk, fingerprint, body)
