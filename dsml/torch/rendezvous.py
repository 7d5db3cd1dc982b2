"""Rendezvous of a torch process group: where its dsml group's registry is (adapter layer).

`create_backend` is the creator torch calls for the backend "dsml": under `dsml run` the
first group joins the launcher's registry; otherwise group rank 0 hosts a registry
(`HostedRegistry`, on a loop thread of its own) and publishes its address in torch's
store, where the other ranks read it. Each rank then joins with the blocking API and
gets a `ProcessGroupDsml` (process_group.py).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from ..blocking import LoopThread
from ..blocking import init as blocking_init
from ..membership import Registry, open_registry
from ..transport.addresses import format_tcp, resolve_host
from ..transport.secret import adopt_published, secret_to_publish
from .process_group import ProcessGroupDsml
from .store import keep_store_server

__all__ = ["HostedRegistry", "create_backend"]

_STORE_KEY = "dsml/registry"
_FORMATIONS_KEY = "dsml/formations"


class HostedRegistry:
    """A dsml registry hosted by this process on a loop thread of its own (rank 0)."""

    def __init__(self, host: str) -> None:
        self._loop = LoopThread("dsml-registry")
        try:
            self.registry: Registry = self._loop.run(
                open_registry(format_tcp(host, 0)), "open_registry"
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
    publishes its address in torch's store, and a fresh job secret unless the environment
    names one; the other ranks read them there.
    """
    global _default_taken
    timeout_s = timeout.total_seconds()
    if rank == 0 and not dist.is_initialized() and not _agent_store():
        keep_store_server(store)  # the default group's: rank 0 serves it (store.py)
    hosted: HostedRegistry | None = None
    registry = os.environ.get("DSML_REGISTRY", "").strip()
    if registry and not _default_taken and str(size) == os.environ.get("DSML_WORLD_SIZE"):
        _default_taken = True
    else:
        key = f"{_STORE_KEY}/{_formation(store, size)}"
        if rank == 0:
            secret = secret_to_publish("group rank 0 (through torch's store)")
            hosted = HostedRegistry(_registry_host())
            registry = hosted.address
            store.set(f"{key}/secret", secret)
            store.set(key, registry)  # last: who sees the address finds the secret
        else:
            store.wait([key], timeout)
            registry = store.get(key).decode()
            adopt_published(store.get(f"{key}/secret").decode(), "torch's store")
    # Named by the global rank: errors of a sub-group's communicator name its own ranks,
    # and the name tells which process that is.
    name = f"torch rank {dist.get_rank() if dist.is_initialized() else rank}"
    try:
        comm = blocking_init(registry, size, rank=rank, timeout=timeout_s, name=name)
    except BaseException:
        if hosted is not None:
            hosted.close()
        raise
    return ProcessGroupDsml(comm, timeout_s, hosted, store)


def _formation(store: dist.Store, size: int) -> int:
    """Which formation of a group under this store's keys this is (0, 1, ...). A group
    made again after `destroy_process_group` gets torch's same key prefix, and torchrun's
    store keeps keys across groups: without a number of its own, a rank read the address
    of the previous group's registry (gone) and failed after registry_timeout. Every rank
    adds one to a counter as it joins; a formation ends only after all its ranks added,
    so the counter's value over `size` numbers formations alike on every rank."""
    return (int(store.add(_FORMATIONS_KEY, 1)) - 1) // size


def _agent_store() -> bool:
    """Whether torchrun's agent serves the store (every rank is a client), as torch's
    rendezvous decides it."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def _registry_host() -> str:
    """The address rank 0's registry binds: MASTER_ADDR's (a user-named address) or loopback."""
    name = os.environ.get("MASTER_ADDR", "").strip()
    if not name:
        return "127.0.0.1"
    return resolve_host(name, "MASTER_ADDR")
