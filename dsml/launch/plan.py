"""Resolve where the registry is, the world size and the rank, once (launch layer).

Precedence, for each setting on its own: explicit arguments to `dsml.init` > `DSML_*`
variables (`DSML_REGISTRY`, `DSML_WORLD_SIZE`, `DSML_RANK`, `DSML_LOCAL_RANK`, as
`dsml run` sets them) > the launcher's variables (`env.py`). When the registry comes from
the launcher (no address argument, no DSML_REGISTRY), the launcher's rank-0 process
serves it at the rendezvous; under torchrun, whose agent already listens there, rank 0
serves it on a port of its own and publishes that address in the agent's store.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from ..config import env_int
from ..errors import ConfigError
from ..transport import check_address
from ..transport.addresses import format_tcp, split_tcp
from .env import LauncherEnv, detect_launcher

log = logging.getLogger("dsml.launch")

__all__ = ["Hosting", "Rendezvous", "resolve_rendezvous"]


class Hosting(enum.Enum):
    """This process's part in serving the registry."""

    NONE = "none"  # the registry runs elsewhere, at `registry`
    SERVE = "serve"  # serve the registry at `registry` (the launcher's rank 0)
    PUBLISH = "publish"  # serve it on a free port and publish the address in torchrun's store
    LOOKUP = "lookup"  # read the registry's address from torchrun's store


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where and how this process joins its group.

    Attributes:
        registry: the registry's address; None with `Hosting.PUBLISH`/`LOOKUP` (the store
            tells it) .
        world_size: members needed to form the group; None joins a running group.
        rank: the rank to ask for (None: the join order).
        local_rank: its rank on this host (picks the GPU of device="cuda").
        hosting: this process's part in serving the registry.
        store: torchrun's agent store (host, port), with PUBLISH and LOOKUP.
        store_key: the key the registry's address is published under.
        launcher: the launcher the settings came from, if any ("torchrun", "slurm", ...).
        rank0_serves: the launcher's rank-0 process serves the registry, so it may not be
            up yet when this process asks (wait as long as for the group to form).
    """

    registry: str | None
    world_size: int | None
    rank: int | None
    local_rank: int | None = None
    hosting: Hosting = Hosting.NONE
    store: tuple[str, int] | None = None
    store_key: str = ""
    launcher: str | None = None
    rank0_serves: bool = False

    @property
    def registry_host(self) -> str | None:
        """The host of the registry (or of the store that names it), for routing."""
        if self.store is not None:
            return self.store[0]
        if self.registry is not None and self.registry.startswith("tcp://"):
            return split_tcp(self.registry, "the registry address")[0]
        return None


def resolve_rendezvous(
    address: str | None,
    world_size: int | None,
    rank: int | None,
    env: Mapping[str, str],
) -> Rendezvous:
    """Resolve the registry, world size and rank from arguments, DSML_* and the launcher.

    Raises:
        ConfigError: nothing names a registry, a value is malformed or out of range, or the
            launcher's variables contradict each other.
    """
    launcher = detect_launcher(env)
    registry = address or env.get("DSML_REGISTRY", "").strip() or None
    size = _first(world_size, env_int(env, "DSML_WORLD_SIZE"))
    if size is None and launcher is not None:
        size = launcher.world_size
    elif world_size is None and launcher is not None:
        _warn_overridden(launcher, size, env)
    if size is not None and (type(size) is not int or size < 1):
        raise ConfigError(
            f"world_size must be a positive integer (argument or DSML_WORLD_SIZE), got {size!r}"
        )
    # The launcher's rank only means something in the launcher's world.
    own = launcher is not None and (size is None or launcher.world_size in (None, size))
    rank = _first(rank, env_int(env, "DSML_RANK"), launcher.rank if own and launcher else None)
    if rank is not None and size is not None and not 0 <= rank < size:
        raise ConfigError(f"rank={rank} is out of range for world_size={size}")
    local_rank = _first(
        env_int(env, "DSML_LOCAL_RANK"),
        launcher.local_rank if launcher else None,
        env_int(env, "LOCAL_RANK"),
    )
    name = launcher.launcher if launcher else None
    if registry is not None:
        check_address(registry, "registry address")
        return Rendezvous(registry, size, rank, local_rank, launcher=name)
    if launcher is None:
        half = [name for name in ("RANK", "WORLD_SIZE") if name in env]
        hint = ""
        if len(half) == 1:  # an env-style launch needs both to be recognised
            missing = "WORLD_SIZE" if half == ["RANK"] else "RANK"
            hint = f" ({half[0]} is set but {missing} is not: a launcher like torchrun sets both)"
        raise ConfigError(
            "no registry address: call dsml.init('tcp://host:port', world_size=N), set "
            "DSML_REGISTRY, start the script with `dsml run -n N script.py`, or start it "
            f"under torchrun, srun or mpirun (with MASTER_ADDR and MASTER_PORT){hint}"
        )
    return _launcher_rendezvous(launcher, size, rank, local_rank)


def _warn_overridden(launcher: LauncherEnv, size: int | None, env: Mapping[str, str]) -> None:
    """DSML_WORLD_SIZE differs from the launcher's world size: often a variable exported in
    the shell and forgotten, so say so, as the job would otherwise wait out its join
    timeout for ranks that never come. Not under `dsml run`, which sets DSML_RANK too (an
    outer launcher's variables, e.g. an srun step's, may be inherited there)."""
    if launcher.world_size in (None, size) or "DSML_RANK" in env:
        return
    log.warning(
        "DSML_WORLD_SIZE=%s overrides the world size %s set by %s (%s); unset it unless "
        "this group really needs %s members",
        size,
        launcher.world_size,
        launcher.launcher,
        launcher.variables,
        size,
    )


def _launcher_rendezvous(
    launcher: LauncherEnv, size: int | None, rank: int | None, local_rank: int | None
) -> Rendezvous:
    """The launcher names the registry: its rank 0 serves it."""
    if launcher.rendezvous is None:
        raise ConfigError(
            f"started by {launcher.launcher} ({launcher.variables} are set) but nothing names "
            "the rendezvous: set MASTER_ADDR and MASTER_PORT for every rank (mpiexec -genv "
            "MASTER_ADDR host -genv MASTER_PORT port; mpirun -x), or DSML_REGISTRY"
        )
    if size is None:
        raise ConfigError(
            f"{launcher.launcher} ({launcher.variables}) does not say the world size: set "
            "DSML_WORLD_SIZE (or pass world_size)"
        )
    host, port = launcher.rendezvous
    if launcher.agent_store:
        hosting = Hosting.PUBLISH if launcher.rank == 0 else Hosting.LOOKUP
        return Rendezvous(
            None,
            size,
            rank,
            local_rank,
            hosting,
            (host, port),
            launcher.store_key,
            launcher.launcher,
            rank0_serves=True,
        )
    if launcher.rank == 0 and launcher.launcher == "slurm" and launcher.node_rank not in (0, None):
        raise ConfigError(
            f"Slurm's rank 0 runs on node {launcher.node_rank} of the step, not on {host}, the "
            "step's first node, where the other ranks look for the registry: use the default "
            "block distribution, or set MASTER_ADDR to rank 0's host"
        )
    hosting = Hosting.SERVE if launcher.rank == 0 else Hosting.NONE
    registry = format_tcp(host, port)
    return Rendezvous(
        registry, size, rank, local_rank, hosting, launcher=launcher.launcher, rank0_serves=True
    )


def _first(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)
