"""Find (or serve) the registry a plan names, and choose the interface to bind (launch layer).

The async half of the edge: `resolve_rendezvous` decided from the environment what to do;
this does it, with sockets and threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any

from ..config import RegistryConfig
from ..errors import ConfigError
from ..transport.addresses import (
    bracketed,
    family_of,
    format_tcp,
    interface_address,
    is_local_address,
    is_loopback_host,
    loopback_bind,
    resolve_host,
    route_to,
    split_tcp,
)
from .hosted import HostedRegistry
from .plan import Hosting, Rendezvous
from .store import lookup_registry, publish_registry, secret_for_store

__all__ = ["choose_bind", "find_registry"]

log = logging.getLogger("dsml.launch")


async def find_registry(
    plan: Rendezvous,
    *,
    ifname: str | None = None,
    curve: Any = None,
    timeout_s: float = 120.0,
) -> tuple[str, HostedRegistry | None]:
    """The registry's address, and the registry this process serves for its group (if any).

    Raises:
        ConfigError: the rendezvous cannot be bound (in use, not this host's address).
        RegistryUnavailableError: torchrun's store did not answer or name the registry.
    """
    if plan.hosting is Hosting.NONE:
        assert plan.registry is not None
        return plan.registry, None
    if plan.hosting is Hosting.LOOKUP:
        assert plan.store is not None
        return await lookup_registry(plan.store, plan.store_key, timeout_s), None
    if plan.hosting is Hosting.PUBLISH:
        assert plan.store is not None
        host = _local_ip(plan.store[0], ifname)
        secret = secret_for_store()  # adopted before the registry binds with it
        hosted = await _serve(format_tcp(host, 0), curve, plan)
        try:
            await publish_registry(plan.store, plan.store_key, hosted.address, secret, timeout_s)
        except BaseException:
            await hosted.aclose()
            raise
        return hosted.address, hosted
    assert plan.registry is not None
    name, port = split_tcp(plan.registry, "the registry address")
    ip = resolve_host(name, f"the rendezvous host named by {plan.launcher}")
    bind_ip = ip if is_local_address(ip) else "*"  # "*": both families
    if bind_ip != ip:  # e.g. a Kubernetes service address that routes to this pod
        log.warning("%s is not an address of this host: serving the registry on all", ip)
    hosted = await _serve(format_tcp(bind_ip, port), curve, plan)
    return format_tcp(ip, port), hosted


async def _serve(address: str, curve: Any, plan: Rendezvous) -> HostedRegistry:
    hosted = HostedRegistry(RegistryConfig(address=address, curve=curve))
    try:
        await asyncio.to_thread(hosted.start)
    except ConfigError as exc:
        raise ConfigError(
            f"rank 0 of {plan.launcher} serves the group's registry at {address}, but: {exc}. "
            "Is another job (or torch.distributed's own store) using that port? Choose "
            "another MASTER_PORT, or set DSML_REGISTRY to a registry of your own"
        ) from None
    return hosted


def _local_ip(toward: str, ifname: str | None) -> str:
    """The address of this host that others reach: DSML_IFNAME's (of toward's family),
    or the route to toward."""
    if ifname:
        with contextlib.suppress(ConfigError):
            return interface_address(ifname, family_of(resolve_host(toward, "")))
        return interface_address(ifname)
    ip = resolve_host(toward, "the registry's host")
    if is_loopback_host(ip):
        return "::1" if family_of(ip) == socket.AF_INET6 else "127.0.0.1"
    local = route_to(ip)
    if local is None:
        raise ConfigError(f"this host has no route to {bracketed(ip)}: set DSML_IFNAME")
    return local


def choose_bind(explicit: str | None, ifname: str | None, registry: str) -> str:
    """The address a worker's endpoint binds (port 0: the OS chooses).

    An explicit bind (CommConfig.bind, DSML_BIND) wins; then DSML_IFNAME's interface;
    then, for a registry on another host, the interface that routes to it; else loopback.
    Each follows the registry's family: an IPv6 registry gets an IPv6 address (::1 for
    loopback, the interface's IPv6 address for DSML_IFNAME).
    """
    if explicit:
        return explicit
    if not registry.startswith("tcp://"):
        return format_tcp(interface_address(ifname), 0) if ifname else loopback_bind()
    host = split_tcp(registry, "the registry address")[0]
    if ifname:
        return format_tcp(_local_ip(host, ifname), 0)
    if is_loopback_host(host):
        return loopback_bind(registry)
    return format_tcp(_local_ip(host, None), 0)
