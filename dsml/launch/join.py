"""Joining a running group without knowing its size (launch layer)."""

from __future__ import annotations

from ..errors import ConfigError
from ..membership import RegistryClient

__all__ = ["running_world_size"]


async def running_world_size(registry: RegistryClient) -> int:
    """The size of the group running at the registry, to join it at its next boundary.

    Raises:
        ConfigError: no group is running there (world_size is needed to form one).
        RegistryUnavailableError: the registry did not answer.
    """
    status = await registry.status()
    size = status.get("world_size")
    if status.get("formed") and type(size) is int and size > 0:
        return size
    forming = len(status.get("joining", []))
    now = (
        f"a group of world_size={size} is forming ({forming} joined so far): wait until it "
        f"has formed, or pass world_size={size} to be one of its members"
        if forming and type(size) is int
        else "no group is running there"
    )
    raise ConfigError(
        f"dsml.init({registry.address!r}) without world_size joins a running group, but {now}. "
        "To form a new group, pass world_size=N (or set DSML_WORLD_SIZE)"
    )
