"""What a client and a worker daemon send each other (daemon layer).

A job submission carries the function and its arguments pickled with cloudpickle (protocol
5): numpy arrays among the arguments are taken out of the pickle as raw frames, so they
are neither copied into it nor pickled. This is the one place in dsml where received bytes
are unpickled, and only a worker does it, for a client it accepted (see "Security: CURVE"
in docs/operations.md). Results travel the other way as plain values (`dsml.wire.values`):
a client never unpickles what a worker sends.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle

from ..config import CommConfig
from ..errors import ConfigError, ProtocolError
from ..transport import check_address
from ..wire import Envelope, Fields, Kind

__all__ = [
    "BUSY",
    "MAX_JOB_FRAME",
    "MAX_OUTPUT_CHARS",
    "JobSpec",
    "apply_job_config",
    "decode_job",
    "encode_job",
    "envelope",
    "job_config",
]

MAX_OUTPUT_CHARS = 16 * 1024  # text of one JOB_OUTPUT message
BUSY = "the worker is busy with job"  # how a JOB_REFUSED reason starts when it is busy
MAX_JOB_FRAME = 1 << 30  # one frame of a job's arguments or result (a job socket's limit)
_MAX_WORLD = 1 << 16


def encode_job(fn: Callable[..., Any], args: Sequence[Any]) -> list[Any]:
    """[pickle, raw buffers...] of `(fn, args)`; raises what pickling raises."""
    buffers: list[pickle.PickleBuffer] = []
    data = cloudpickle.dumps((fn, tuple(args)), protocol=5, buffer_callback=buffers.append)
    return [data, *(buffer.raw() for buffer in buffers)]


def decode_job(frames: Sequence[memoryview]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """Unpickle a submission (trusted: only called for an accepted client).

    The raw buffers are copied into writable memory, so arrays passed as arguments can be
    reduced in place by the job.
    """
    buffers = [bytearray(frame) for frame in frames[1:]]
    fn, args = pickle.loads(frames[0], buffers=buffers)
    if not callable(fn) or not isinstance(args, tuple):
        raise TypeError("a job submission must hold (callable, tuple of arguments)")
    return fn, args


#: CommConfig fields a client may set for its job (`client.run(..., config=)`); the
#: daemon decides where the job binds and which keys it uses.
JOB_CONFIG_FIELDS = frozenset(
    f.name for f in dataclasses.fields(CommConfig) if f.name not in ("bind", "curve")
)


def job_config(config: CommConfig | None) -> dict[str, Any]:
    """The settings of `config` that differ from the defaults, as plain values."""
    if config is None:
        return {}
    defaults = CommConfig()
    return {
        name: getattr(config, name)
        for name in sorted(JOB_CONFIG_FIELDS)
        if getattr(config, name) != getattr(defaults, name)
    }


def apply_job_config(base: CommConfig, settings: dict[str, Any]) -> CommConfig:
    """`base` with a client's settings; ConfigError for unknown or invalid ones."""
    unknown = set(settings) - JOB_CONFIG_FIELDS
    if unknown:
        raise ConfigError(f"a job cannot set {', '.join(sorted(unknown))} of CommConfig")
    return dataclasses.replace(base, **settings)


class JobSpec:
    """The header of a JOB_SUBMIT, validated."""

    __slots__ = ("config", "group", "job", "rank", "world_size")

    def __init__(
        self,
        job: str,
        rank: int,
        world_size: int,
        group: str | None,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.job = job
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.config = config or {}

    def to_wire(self) -> dict[str, Any]:
        body = {"job": self.job, "rank": self.rank, "world_size": self.world_size}
        if self.group is not None:
            body["group"] = self.group
        if self.config:
            body["config"] = self.config
        return body

    @classmethod
    def from_wire(cls, body: Any) -> JobSpec:
        fields = Fields(body, "JobSubmit")
        world_size = fields.get_int("world_size", 1, _MAX_WORLD)
        rank = fields.get_int("rank", 0, world_size - 1)
        group = fields.get_str("group", 256, optional=True)
        if group is not None:
            try:
                check_address(group, "job registry address")
            except ValueError as exc:
                raise ProtocolError(str(exc)) from None
        if rank > 0 and group is None:
            raise ProtocolError("JobSubmit: ranks above 0 need the job's registry address")
        config = body.get("config", {}) if isinstance(body, dict) else {}
        if not isinstance(config, dict) or len(config) > len(JOB_CONFIG_FIELDS):
            raise ProtocolError("JobSubmit: config must be a small map")
        if not all(isinstance(v, bool | int | float | str) for v in config.values()):
            raise ProtocolError("JobSubmit: config values must be numbers, booleans or text")
        return cls(fields.get_str("job", 64), rank, world_size, group, config)


def envelope(kind: Kind, body: dict[str, Any]) -> Envelope:
    return Envelope(kind, 0, body=body)
