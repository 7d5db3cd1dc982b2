"""What a launcher told this process: its rank, the world size, the rendezvous (launch layer).

Pure functions over a mapping of environment variables, so every launcher can be tested
without starting it. Detection order, first match wins (the innermost launcher sets its
variables last, and an outer one's may still be inherited):

1. env-style, as torchrun and Kubernetes' PyTorchJob set it: RANK and WORLD_SIZE
   (LOCAL_RANK; MASTER_ADDR and MASTER_PORT name the rendezvous). Under torchrun,
   TORCHELASTIC_USE_AGENT_STORE=True means the agent's TCPStore already listens there.
2. Open MPI's mpirun: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK.
3. MPICH's Hydra and Intel MPI: PMI_RANK, PMI_SIZE, MPI_LOCALRANKID.
4. PMIx: PMIX_RANK (the world size then comes from Slurm or DSML_WORLD_SIZE).
5. Slurm's srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID,
   SLURM_STEP_NODELIST (the step's nodes), SLURM_JOB_ID and SLURM_STEP_ID.

MPI launchers name no rendezvous of their own: MASTER_ADDR/MASTER_PORT (or DSML_REGISTRY)
do. When srun started the MPI ranks directly (its task ids equal the MPI ranks), Slurm's
rendezvous serves. Under Slurm the rendezvous is MASTER_ADDR, else the first node of the
step, at port MASTER_PORT, else `slurm_port(SLURM_JOB_ID, SLURM_STEP_ID)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..config import env_int
from ..errors import ConfigError
from .hostlist import expand_hostlist

__all__ = ["LauncherEnv", "detect_launcher", "slurm_port"]

_SLURM_PORT_BASE = 20000


@dataclass(frozen=True, slots=True)
class LauncherEnv:
    """One process's place in a job, as its launcher's variables describe it.

    Attributes:
        launcher: "torchrun", "env" (RANK/WORLD_SIZE without torchrun), "openmpi",
            "mpich" (Hydra or Intel MPI), "pmix" or "slurm".
        rank: this process's rank.
        world_size: how many processes the launcher started (None: it does not say).
        local_rank: its rank among the processes on this host, if the launcher says.
        node_rank: the index of this host among the job's hosts, if the launcher says.
        rendezvous: (host, port) where the rank-0 process serves the registry (or, with
            `agent_store`, where torchrun's agent store listens); None if not named.
        agent_store: torchrun's agent already serves a TCPStore at `rendezvous`.
        store_key: where in that store the registry's address is published.
        variables: the variables this was read from, for messages.
    """

    launcher: str
    rank: int
    world_size: int | None
    local_rank: int | None = None
    node_rank: int | None = None
    rendezvous: tuple[str, int] | None = None
    agent_store: bool = False
    store_key: str = ""
    variables: str = ""


def detect_launcher(env: Mapping[str, str]) -> LauncherEnv | None:
    """The launcher whose variables are in `env` (see the module docstring), or None.

    Raises:
        ConfigError: a launcher's variable is malformed (not an integer, a bad host list,
            MASTER_PORT out of range).
    """
    for detect in (_env_style, _mpi):
        found = detect(env)
        if found is not None:
            return _with_slurm_rendezvous(found, env)
    return _slurm(env)


def slurm_port(job_id: int, step_id: int = 0) -> int:
    """The registry port of a Slurm step when MASTER_PORT is not set.

    `20000 + (job_id % 10000) * 4 + step_id % 4`: in 20000-59999, different for 10000
    consecutive jobs and for up to four steps of one job running at the same time.
    """
    return _SLURM_PORT_BASE + (job_id % 10000) * 4 + step_id % 4


def _master(env: Mapping[str, str]) -> tuple[str, int] | None:
    host = env.get("MASTER_ADDR", "").strip()
    if host.startswith("[") and host.endswith("]"):  # an IPv6 address written bracketed
        host = host[1:-1]
    port = env_int(env, "MASTER_PORT")
    if not host or port is None:
        return None
    if not 0 < port < 65536:
        raise ConfigError(f"MASTER_PORT={port} is not a TCP port (1-65535)")
    return host, port


def _env_style(env: Mapping[str, str]) -> LauncherEnv | None:
    rank, size = env_int(env, "RANK"), env_int(env, "WORLD_SIZE")
    if rank is None or size is None:
        return None
    torchrun = "TORCHELASTIC_RUN_ID" in env or "TORCHELASTIC_USE_AGENT_STORE" in env
    master = _master(env)
    agent_store = master is not None and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    # One key per run and restart: a restarted group must not read the old registry.
    run_id = env.get("TORCHELASTIC_RUN_ID", "none")
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return LauncherEnv(
        launcher="torchrun" if torchrun else "env",
        rank=rank,
        world_size=size,
        local_rank=env_int(env, "LOCAL_RANK"),
        node_rank=env_int(env, "GROUP_RANK"),
        rendezvous=master,
        agent_store=agent_store,
        store_key=f"dsml/{run_id}/attempt_{attempt}/registry" if agent_store else "",
        variables="RANK/WORLD_SIZE",
    )


#: MPI launchers: name, then the variables of rank, size, local rank and node rank (None:
#: the launcher sets none). Open MPI; MPICH Hydra and Intel MPI; PMIx (rank only).
_MPI_VARIABLES: tuple[tuple[str, str, str | None, str | None, str | None], ...] = (
    (
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_NODE_RANK",
    ),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", None),
    ("pmix", "PMIX_RANK", None, None, None),
)


def _mpi(env: Mapping[str, str]) -> LauncherEnv | None:
    """The first MPI launcher whose rank variable is set, read through `_MPI_VARIABLES`."""
    for launcher, rank_var, size_var, local_var, node_var in _MPI_VARIABLES:
        rank = env_int(env, rank_var)
        if rank is None:
            continue
        return LauncherEnv(
            launcher=launcher,
            rank=rank,
            world_size=env_int(env, size_var) if size_var else None,
            local_rank=env_int(env, local_var) if local_var else None,
            node_rank=env_int(env, node_var) if node_var else None,
            rendezvous=_master(env),
            variables=f"{rank_var}/{size_var}" if size_var else rank_var,
        )
    return None


def _slurm(env: Mapping[str, str]) -> LauncherEnv | None:
    rank, nodelist = env_int(env, "SLURM_PROCID"), env.get("SLURM_STEP_NODELIST", "").strip()
    if rank is None or not nodelist:
        return None  # a batch script's own variables, outside any srun step
    return LauncherEnv(
        launcher="slurm",
        rank=rank,
        world_size=env_int(env, "SLURM_STEP_NUM_TASKS") or env_int(env, "SLURM_NTASKS"),
        local_rank=env_int(env, "SLURM_LOCALID"),
        node_rank=env_int(env, "SLURM_NODEID"),
        rendezvous=_master(env) or _slurm_rendezvous(env, nodelist),
        variables="SLURM_PROCID/SLURM_NTASKS",
    )


def _slurm_rendezvous(env: Mapping[str, str], nodelist: str) -> tuple[str, int]:
    first = expand_hostlist(nodelist)[0]
    port = env_int(env, "MASTER_PORT")
    if port is None:
        job_id = env_int(env, "SLURM_JOB_ID")
        if job_id is None:
            raise ConfigError(
                "under srun without SLURM_JOB_ID there is no port to derive the registry's "
                "from: set MASTER_PORT (or DSML_REGISTRY)"
            )
        port = slurm_port(job_id, env_int(env, "SLURM_STEP_ID") or 0)
    return first, port


def _with_slurm_rendezvous(found: LauncherEnv, env: Mapping[str, str]) -> LauncherEnv:
    """An MPI launch without MASTER_ADDR that srun made directly uses Slurm's rendezvous."""
    if found.rendezvous is not None or found.launcher in ("torchrun", "env"):
        return found
    slurm = _slurm(env)
    if slurm is None or slurm.rank != found.rank:
        return found
    if found.world_size is not None and found.world_size != slurm.world_size:
        return found  # mpirun's daemons ran under srun; their task ids are not the ranks
    return LauncherEnv(
        launcher=found.launcher,
        rank=found.rank,
        world_size=slurm.world_size,
        local_rank=found.local_rank if found.local_rank is not None else slurm.local_rank,
        node_rank=slurm.node_rank,
        rendezvous=slurm.rendezvous,
        variables=found.variables,
    )
