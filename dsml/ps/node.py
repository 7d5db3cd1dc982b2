"""Opening the parameter servers of a job: one object per rank, server or worker (ps layer).

Every rank of the communicator calls `open_ps` with the same parameters (names, shapes,
dtypes; the values of rank 0 are broadcast, so every server starts from them). The last
`servers` ranks become servers and call `serve()`; the others are workers and call
`push`, `pull` and finally `finish`.
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
from .client import Client, PSHandle
from .layout import KeySpec, Layout, shard
from .optim import SGD, Optimizer
from .push_codec import push_codec_from
from .replica import Replica
from .roles import Roles
from .server import Server
from .shard_state import CONSISTENCY, ShardState

__all__ = ["PSConfig", "ParameterServers", "open_ps"]


@dataclass(frozen=True)
class PSConfig:
    """How the servers keep a table consistent and update it.

    Args:
        servers: how many ranks serve (the last ones); at least one rank must work.
        consistency: "bsp", "ssp" or "async" (see `dsml.ps.shard_state`).
        staleness: for "ssp", how many steps a worker may run ahead of the slowest.
        optimizer: applied by the servers (`SGD`, `Momentum`, `Adam`, or your own).
        timeout: seconds one request may wait for its reply (a BSP step waits for the
            slowest worker), and a server for a worker's next request.
        max_piece_bytes: keys larger than this are cut into pieces (default: see layout).
        push_compression: how pushed gradients travel: "none", "bf16", "fp16" or
            "topk[:RATIO]" (with error feedback; see `dsml.ps.push_codec`).
        replicas: 1 keeps a copy of each server's shard on the next server (primary-backup,
            see `dsml.ps.replica`): a lost server's shard is served by its backup.
    """

    servers: int = 1
    consistency: str = "bsp"
    staleness: int = 0
    optimizer: Optimizer = field(default_factory=SGD)
    timeout: float = 300.0
    max_piece_bytes: int | None = None
    push_compression: str = "none"
    replicas: int = 0

    def __post_init__(self) -> None:
        if self.replicas not in (0, 1):
            raise ConfigError(
                f"replicas must be 0 or 1 (a backup per shard), got {self.replicas!r}"
            )
        if self.replicas and self.servers < 2:
            raise ConfigError("replicas=1 needs servers >= 2: a shard's backup is the next server")
        push_codec_from(self.push_compression)  # raises ConfigError for a bad name
        if self.consistency not in CONSISTENCY:
            raise ConfigError(
                f"consistency must be one of {', '.join(CONSISTENCY)}, got {self.consistency!r}"
            )
        if not isinstance(self.staleness, int) or self.staleness < 0:
            raise ConfigError(f"staleness must be an integer >= 0, got {self.staleness!r}")
        if self.staleness and self.consistency != "ssp":
            raise ConfigError(
                f"staleness applies to consistency='ssp' only, not {self.consistency!r}"
            )
        if not self.timeout > 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {self.timeout!r}")


class ParameterServers:
    """This rank's part in the parameter servers: `role` is "server" or "worker"."""

    def __init__(self, comm: Communicator, config: PSConfig, layout: Layout, roles: Roles) -> None:
        self.config, self.layout, self.roles = config, layout, roles
        self.role, self.index = roles.role_of(comm.member_id)
        self._server: Server | None = None
        self._replica: Replica | None = None
        self._client: Client | None = None
        self._comm = comm

    def _start(self, initial: Mapping[str, np.ndarray]) -> None:
        config, comm = self.config, self._comm
        replicated = config.replicas > 0
        if self.role == "server":
            servers = len(self.roles.servers)
            backup = self.roles.servers[(self.index + 1) % servers] if replicated else None
            self._server = Server(
                comm,
                self.roles,
                self.index,
                self.layout,
                self._state(initial, self.index),
                config.timeout,
                push_codec_from(config.push_compression),
                backup,
            )
            if replicated:
                shard = (self.index - 1) % servers
                self._replica = Replica(
                    comm,
                    self.roles,
                    shard,
                    self.layout,
                    self._state(initial, shard),
                    config.timeout,
                    push_codec_from(config.push_compression),
                )
        else:
            codec = push_codec_from(config.push_compression)  # each worker its own residuals
            self._client = Client(
                comm, self.roles, self.index, self.layout, config.timeout, codec, replicated
            )

    def _state(self, initial: Mapping[str, np.ndarray], shard: int) -> ShardState:
        config = self.config
        workers = range(len(self.roles.workers))
        return ShardState(
            self.layout,
            shard,
            initial,
            config.optimizer,
            workers,
            config.consistency,
            config.staleness,
        )

    @property
    def is_server(self) -> bool:
        return self.role == "server"

    @property
    def num_workers(self) -> int:
        return len(self.roles.workers)

    def _worker(self, what: str) -> Client:
        if self._client is None:
            raise ConfigError(
                f"{what} is for workers; this rank is parameter server {self.index}: call serve()"
            )
        return self._client

    async def serve(self) -> None:
        """(Servers) answer the workers until every one has finished or was lost."""
        if self._server is None:
            raise ConfigError(f"serve() is for servers; this rank is worker {self.index}")
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._server.serve())
            if self._replica is not None:
                tasks.create_task(self._replica.serve())

    def push(self, key: str, grad: np.ndarray) -> PSHandle:
        """(Workers) push a gradient of `key`; batched with the calls of this loop turn."""
        return self._worker("push").push(key, grad)

    def pull(self, key: str, out: np.ndarray) -> PSHandle:
        """(Workers) fill `out` with `key`'s value once the consistency model allows."""
        return self._worker("pull").pull(key, out)

    def flush(self) -> None:
        """(Workers) send the batched calls now instead of on the next loop turn."""
        self._worker("flush").flush()

    async def finish(self, pull: Mapping[str, np.ndarray] | None = None) -> None:
        """(Workers) this worker is done; returns once all are, `pull` filled with the
        final parameters."""
        await self._worker("finish").finish(pull)

    def stats(self) -> dict[str, Any]:
        """Figures for tests and logs: (servers) updates applied, the largest SSP lead seen,
        the workers lost, and under BSP the workers whose gradients each step of each
        piece summed (`contributors`, to replay a run), and the same of the replica it holds
        (`replica`, with `shard` and `took_over`); (workers) bytes of their request and
        reply messages."""
        if self._server is None:
            return self._client.traffic() if self._client is not None else {}
        figures = self._state_stats(self._server.state)
        if self._replica is not None:
            replica = self._state_stats(self._replica.state)
            replica.update(shard=self._replica.shard, took_over=self._replica.took_over)
            figures["replica"] = replica
        return figures

    def _state_stats(self, state: ShardState) -> dict[str, Any]:
        return {
            "updates": {p: s.updates for p, s in state.pieces.items()},
            "max_lead": state.max_lead,
            "contributors": {p: list(s.contributors) for p, s in state.pieces.items()},
            "lost": sorted(set(range(self.num_workers)) - state.live - state.done),
        }

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    def __repr__(self) -> str:
        config = self.config
        return f"<ParameterServers {self.role} {self.index}, {config.consistency}, {self.layout!r}>"


def open_ps(
    comm: Communicator,
    params: Mapping[str, np.ndarray],
    config: PSConfig | None = None,
    **options: Any,
) -> Opener[ParameterServers]:
    """Open the parameter servers on every rank of `comm` (a collective: all ranks call it).

    `params` names the parameters and gives their initial values (rank 0's are used);
    `config` (or its fields as keywords) says how many servers and which consistency.
    """
    config = config or PSConfig(**options)

    async def start() -> ParameterServers:
        specs = [KeySpec.of(name, np.asarray(value)) for name, value in params.items()]
        layout = shard(specs, config.servers, config.max_piece_bytes)
        roles = Roles.of(comm.view, config.servers)
        initial = {name: np.array(value, copy=True) for name, value in params.items()}
        await asyncio.gather(*(comm.broadcast(v, root=0) for v in initial.values()))
        ps = ParameterServers(comm, config, layout, roles)
        ps._start(initial)
        return ps

    return Opener(start, name="dsml.ps.open_ps")
