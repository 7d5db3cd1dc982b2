"""Launch layer: start under any launcher (torchrun, srun, mpirun, `dsml run`).

Between membership and the communicator. `env.py` reads a launcher's variables,
`hostlist.py` expands Slurm host lists, `plan.py` resolves arguments > DSML_* > launcher
into a `Rendezvous` (pure functions over a mapping, tested without launchers);
`meet.py` carries a plan out: it serves the registry in the rank-0 process (`hosted.py`,
a thread of its own), or publishes and reads its address through torchrun's agent store
(`store.py`, the only place torch is imported), and chooses the interface to bind.

What `dsml run` runs is here too, imported by the CLI only (not by this package, so
`import dsml` does not load it): `job.py` (one job: its registry, launcher and link),
`launcher.py` (start and supervise the ranks: `rank_setup.py`, `output.py`,
`failure.py`), the fork server (`forkserver.py`; its own process, `forkserver_loop.py`)
and the launchers' link of a multi-node run (`nodes.py`, `node_board.py`, `node_link.py`).
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
