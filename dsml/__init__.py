"""dsml: peer-to-peer collectives for machine-learning workers over ZeroMQ and asyncio.

    import dsml, numpy as np

    async with dsml.init("tcp://127.0.0.1:5555", world_size=4) as comm:
        x = np.arange(8, dtype=np.float32)
        await comm.all_reduce(x)          # in place on every rank

See README.md and docs/ for concepts, the protocol and the command line.
"""

from . import elastic, log
from ._version import __version__
from .collectives.ops import ReduceOp
from .communicator import CollectiveHandle, Communicator, init
from .config import CommConfig, RegistryConfig
from .daemon import Client, LocalCluster, WorkerInfo
from .engine import Engine, OpHandle, SerialEngine, Tagged, Var
from .errors import (
    CollectiveAbortedError,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ConcurrentCallsError,
    ConfigError,
    DependencyFailedError,
    DsmlError,
    EvictedError,
    JobTimeoutError,
    JoinTimeoutError,
    MemberLeftError,
    MembershipChangedError,
    NoQuorumError,
    PeerLostError,
    ProtocolError,
    RegistryUnavailableError,
    RemoteError,
    WorkerLostError,
)
from .membership import Registry, open_registry

__all__ = [
    "Client",
    "CollectiveAbortedError",
    "CollectiveError",
    "CollectiveHandle",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommConfig",
    "Communicator",
    "ConcurrentCallsError",
    "ConfigError",
    "DependencyFailedError",
    "DsmlError",
    "Engine",
    "EvictedError",
    "JobTimeoutError",
    "JoinTimeoutError",
    "LocalCluster",
    "MemberLeftError",
    "MembershipChangedError",
    "NoQuorumError",
    "OpHandle",
    "PeerLostError",
    "ProtocolError",
    "ReduceOp",
    "Registry",
    "RegistryConfig",
    "RegistryUnavailableError",
    "RemoteError",
    "SerialEngine",
    "Tagged",
    "Var",
    "WorkerInfo",
    "WorkerLostError",
    "__version__",
    "elastic",
    "init",
    "log",
    "open_registry",
]

_LAZY = ("blocking", "testing")  # submodules `dsml.X` gives without `import dsml.X`


def __getattr__(name: str) -> object:
    """`dsml.blocking` and `dsml.testing` after a plain `import dsml`, imported on first
    use (the README writes `with dsml.blocking.init() as comm:`)."""
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


log.configure_from_env()  # DSML_LOG_LEVEL=debug shows the library's lines on stderr (the fork
# server of `dsml run` calls it again in each rank: dsml/launch/forkserver_loop.py)
