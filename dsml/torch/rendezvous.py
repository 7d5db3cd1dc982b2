"""Rendezvous of a torch process group: where its dsml group's registry is (adapter layer).

`create_backend` is the creator torch calls for the backend "dsml": under `dsml run` the
first group joins the launcher's registry; otherwise group rank 0 hosts a registry
(`HostedRegistry`, on a loop thread of its own) and publishes its address in torch's
store, where the other ranks read it. Each rank then joins with the blocking API and
gets a `ProcessGroupDsml` (process_group.py).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist

from ..blocking import LoopThread
from ..blocking import init as blocking_init
from ..errors import ConfigError
from ..membership import Registry, open_registry
from .process_group import ProcessGroupDsml

__all__ = ["HostedRegistry", "create_backend"]

_STORE_KEY = "dsml/registry"


class HostedRegistry:
    """A dsml registry hosted by this process on a loop thread of its own (rank 0)."""

    def __init__(self, host: str) -> None:
        self._loop = LoopThread("dsml-registry")
        try:
            self.registry: Registry = self._loop.run(
                open_registry(f"tcp://{host}:0"), "open_registry"
            )
        except BaseException:
            self._loop.stop()
            raise

    @property
    def address(self) -> str:
        return self.registry.address

    def close(self) -> None:
        try:
            self._loop.run(self.registry.aclose(), "close registry")
        finally:
            self._loop.stop()


_default_taken = False  # the first group under `dsml run` joins its registry


def create_backend(store: dist.Store, rank: int, size: int, timeout: timedelta) -> ProcessGroupDsml:
    """torch's backend creator: join (or form) a dsml group for this process group.

    Under `dsml run` (DSML_REGISTRY set) the first group joins the launcher's registry.
    Otherwise group rank 0 hosts a registry (on MASTER_ADDR's address, else loopback) and
    publishes its address in torch's store; the other ranks read it there.
    """
    global _default_taken
    timeout_s = timeout.total_seconds()
    hosted: HostedRegistry | None = None
    registry = os.environ.get("DSML_REGISTRY", "").strip()
    if registry and not _default_taken and str(size) == os.environ.get("DSML_WORLD_SIZE"):
        _default_taken = True
    elif rank == 0:
        hosted = HostedRegistry(_registry_host())
        registry = hosted.address
        store.set(_STORE_KEY, registry)
    else:
        store.wait([_STORE_KEY], timeout)
        registry = store.get(_STORE_KEY).decode()
    try:
        comm = blocking_init(
            registry, size, rank=rank, timeout=timeout_s, name=f"torch rank {rank}"
        )
    except BaseException:
        if hosted is not None:
            hosted.close()
        raise
    return ProcessGroupDsml(comm, timeout_s, hosted)


def _registry_host() -> str:
    """The address rank 0's registry binds: MASTER_ADDR's (a user-named address) or loopback."""
    name = os.environ.get("MASTER_ADDR", "").strip()
    if not name:
        return "127.0.0.1"
    try:
        return socket.gethostbyname(name)
    except OSError as exc:
        raise ConfigError(f"MASTER_ADDR={name!r} does not resolve: {exc}") from exc
