"""Configuration objects (leaf module).

Explicit arguments win over `DSML_*` environment variables, which win over defaults. The
environment is read here, once, by the edges (`dsml.init`, the CLI); inner layers receive
these frozen objects and never look at the environment.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

__all__ = ["CommConfig", "RegistryConfig", "env_float", "env_int", "parse_size"]

_MiB = 1 << 20


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _positive(name: str, value: float) -> None:
    _require(
        isinstance(value, int | float) and math.isfinite(value) and value > 0,
        f"{name} must be a positive number of seconds, got {value!r}",
    )


@dataclass(frozen=True, slots=True)
class CommConfig:
    """Settings of one communicator; every rank of a group should use the same values.

    Attributes:
        timeout: default budget in seconds of one collective (each call may override it).
        join_timeout: how long `init` waits for the group to form.
        registry_timeout: how long to wait for the registry to answer at all.
        probe_timeout: after a timeout, how long to ask the peers where they are.
        progress_after: a collective still waiting on its peers after this many seconds
            logs a warning naming the ranks it waits for and where each was last seen,
            then again after twice as long, four times, ... until it ends or times out.
            0 or None: no such lines.
        view_timeout: after a member was lost, how long a call waits for the registry's
            new view before failing.
        chunk_bytes: pipeline unit of the large-message algorithms.
        max_frame_bytes: largest payload frame accepted from a peer (ZeroMQ drops the
            connection of a peer that sends more). Published in this member's view
            record: peers keep their frames, and `auto` its chunks, within the smallest
            of the view.
        zero_copy_min_bytes: frames at least this large are sent without copying.
        bind: address the worker's endpoint binds; port 0 lets the OS choose.
        tune_malloc: raise glibc's malloc thresholds so ZeroMQ's receive buffers are
            reused instead of page-faulted anew (see dsml/transport/malloc.py).
        gpu_reduce: where collectives on cupy arrays compute: "host" stages the array
            through pinned memory and runs numpy's algorithms there; "device" runs them on
            the cupy array with cupy kernels. Unmeasured so far (docs/operations.md).
        engine_trace: `comm.engine` records a timeline of its ops (`engine.trace()`,
            `engine.write_trace(path)`; see docs/engine.md).
        curve: CURVE keys (`dsml.transport.Curve`) for every socket of the communicator:
            its peer links and its registry connection are encrypted and authenticated.
            Worker daemons started with `--curve-keys` set it for their jobs.
        shm: members on the same host exchange data through shared memory (/dev/shm);
            on by default (`DSML_SHM=0` or `shm=False` turns it off; docs/shm.md).
        shm_stage_bytes: how much of one rank's input is in shared memory at once
            (larger arrays go through in pieces). The same on every rank: calls between
            ranks that differ fail with `CollectiveMismatchError`.
        shm_max_bytes: the most /dev/shm one rank's data segment may take; a collective
            that needs more goes over TCP (one warning).
        flight_dir: where the root communicator writes this rank's flight record on a
            timeout, a collective failure and SIGUSR1 (`DSML_FLIGHT_DIR`; None: off;
            docs/observability.md).
    """

    timeout: float = 120.0
    join_timeout: float = 120.0
    registry_timeout: float = 10.0
    probe_timeout: float = 0.5
    progress_after: float | None = 5.0
    view_timeout: float = 30.0
    chunk_bytes: int = 4 * _MiB
    max_frame_bytes: int = 64 * _MiB
    zero_copy_min_bytes: int = 64 * 1024
    bind: str = "tcp://127.0.0.1:0"
    tune_malloc: bool = True
    gpu_reduce: str = "host"
    engine_trace: bool = False
    curve: Any = None
    shm: bool = True
    shm_stage_bytes: int = 8 * _MiB
    shm_max_bytes: int = 1024 * _MiB
    flight_dir: str | None = None

    def __post_init__(self) -> None:
        _require(
            isinstance(self.shm_stage_bytes, int) and self.shm_stage_bytes >= 4096,
            f"shm_stage_bytes must be an integer >= 4096, got {self.shm_stage_bytes!r}",
        )
        _require(
            isinstance(self.shm_max_bytes, int) and self.shm_max_bytes >= 0,
            f"shm_max_bytes must be a non-negative integer, got {self.shm_max_bytes!r}",
        )
        for name in (
            "timeout",
            "join_timeout",
            "registry_timeout",
            "probe_timeout",
            "view_timeout",
        ):
            _positive(name, getattr(self, name))
        _require(
            self.progress_after is None
            or (
                isinstance(self.progress_after, int | float)
                and math.isfinite(self.progress_after)
                and self.progress_after >= 0
            ),
            "progress_after must be a number of seconds >= 0 (0 or None: off), "
            f"got {self.progress_after!r}",
        )
        _require(
            isinstance(self.chunk_bytes, int) and self.chunk_bytes >= 4096,
            f"chunk_bytes must be an integer >= 4096, got {self.chunk_bytes!r}",
        )
        _require(
            isinstance(self.max_frame_bytes, int) and self.max_frame_bytes >= self.chunk_bytes,
            f"max_frame_bytes ({self.max_frame_bytes!r}) must be >= chunk_bytes "
            f"({self.chunk_bytes})",
        )
        _require(
            isinstance(self.zero_copy_min_bytes, int) and self.zero_copy_min_bytes >= 0,
            "zero_copy_min_bytes must be a non-negative integer",
        )
        _require(
            isinstance(self.bind, str) and self.bind.startswith(("tcp://", "ipc://")),
            f"bind must be a tcp:// or ipc:// address, got {self.bind!r}",
        )
        _require(
            self.gpu_reduce in ("host", "device"),
            f"gpu_reduce must be 'host' or 'device', got {self.gpu_reduce!r}",
        )


@dataclass(frozen=True, slots=True)
class RegistryConfig:
    """Settings of a registry server.

    Attributes:
        address: where to bind; port 0 lets the OS choose.
        max_message_bytes: largest message accepted from anyone (larger: dropped).
        heartbeat_interval: seconds between a member's heartbeats.
        heartbeat_timeout: a member silent this long is declared dead (must exceed twice
            the interval). Pauses shorter than this never evict anyone; a killed process
            is found much sooner, when its peers' connections drop.
        join_window: after a worker asks to join a running group, how long to wait for
            others before admitting them together (one epoch for all of them).
        curve: CURVE keys (`dsml.transport.Curve`, role "server"): only allowlisted keys
            are heard, and everything is encrypted.
    """

    address: str = "tcp://127.0.0.1:0"
    max_message_bytes: int = 1 * _MiB
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    join_window: float = 0.2
    curve: Any = None

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval", "heartbeat_timeout", "join_window"):
            _positive(name, getattr(self, name))
        _require(
            self.heartbeat_timeout > 2 * self.heartbeat_interval,
            f"heartbeat_timeout ({self.heartbeat_timeout:g} s) must exceed twice "
            f"heartbeat_interval ({self.heartbeat_interval:g} s), or one late heartbeat "
            "would evict a live worker",
        )
        _require(
            isinstance(self.address, str) and self.address.startswith(("tcp://", "ipc://")),
            f"registry address must be tcp://host:port or ipc://path, got {self.address!r}",
        )
        _require(self.max_message_bytes >= 4096, "max_message_bytes must be >= 4096")


_SIZE_SUFFIXES = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """Parse a byte size such as `4096`, `4K`, `1M`, `64MiB` or `1G` (binary units)."""
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    digits = raw.rstrip("KMG")
    suffix = raw[len(digits) :]
    if not digits.isdigit() or suffix not in _SIZE_SUFFIXES:
        raise ConfigError(f"cannot read size {text!r}: use a number with K, M or G (e.g. 64K)")
    return int(digits) * _SIZE_SUFFIXES[suffix]


def env_int(env: Mapping[str, str], name: str) -> int | None:
    """Read an integer environment variable; absent or empty gives None."""
    value = env.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None


def env_float(env: Mapping[str, str], name: str) -> float | None:
    """Read a float environment variable; absent or empty gives None."""
    value = env.get(name, "").strip()
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not a number") from None


def environ() -> Mapping[str, str]:
    """The process environment, read only by the edges (init and the CLI)."""
    return os.environ
