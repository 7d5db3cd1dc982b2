"""Launch layer: start under any launcher (torchrun, srun, mpirun, `dsml run`).

Between membership and the communicator. `env.py` reads a launcher's variables,
`hostlist.py` expands Slurm host lists, `plan.py` resolves arguments > DSML_* > launcher
into a `Rendezvous` (pure functions over a mapping, tested without launchers);
`meet.py` carries a plan out: it serves the registry in the rank-0 process (`hosted.py`,
a thread of its own), or publishes and reads its address through torchrun's agent store
(`store.py`, the only place torch is imported), and chooses the interface to bind.
"""

from .env import LauncherEnv, detect_launcher, slurm_port
from .hosted import HostedRegistry
from .hostlist import expand_hostlist
from .meet import choose_bind, find_registry
from .plan import Hosting, Rendezvous, resolve_rendezvous

__all__ = [
    "HostedRegistry",
    "Hosting",
    "LauncherEnv",
    "Rendezvous",
    "choose_bind",
    "detect_launcher",
    "expand_hostlist",
    "find_registry",
    "resolve_rendezvous",
    "slurm_port",
]
