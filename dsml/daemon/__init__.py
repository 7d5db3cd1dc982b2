"""Worker daemons, the client that gives them jobs, and a local cluster (daemon layer).

- `WorkerDaemon` (`dsml worker`): waits for jobs and runs each with a communicator over
  exactly that job's workers.
- `Client`: `await client.run(fn, *args, workers=k)` runs `fn(comm, *args)` on k idle
  workers and returns their results in rank order.
- `LocalCluster`: a registry and n worker processes on this machine, for notebooks.
"""

from .client import Client, WorkerInfo
from .cluster import LocalCluster, WorkerProcess
from .worker import WorkerConfig, WorkerDaemon

__all__ = ["Client", "LocalCluster", "WorkerConfig", "WorkerDaemon", "WorkerInfo", "WorkerProcess"]
