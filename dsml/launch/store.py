"""torchrun's agent store as the place to publish the registry's address (launch layer).

Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) the agent already serves a TCPStore at
MASTER_ADDR:MASTER_PORT, so nobody else can bind that port. Rank 0 then serves the
registry on a port of its own and sets its address under one key of the store; the other
ranks wait for that key. Unless the environment names a job secret, rank 0 also makes one
and sets it under `KEY/secret` (torch's store is as open as torch.distributed itself: see
docs/security.md). torch is imported here only, and only on this path.
"""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

from ..errors import ConfigError, RegistryUnavailableError
from ..transport.addresses import bracketed
from ..transport.secret import adopt_published, secret_to_publish

__all__ = ["lookup_registry", "publish_registry", "secret_for_store"]


def _client(store: tuple[str, int], timeout_s: float) -> Any:
    try:
        from torch.distributed import TCPStore  # type: ignore[attr-defined,unused-ignore]
    except ImportError as exc:
        raise ConfigError(
            "TORCHELASTIC_USE_AGENT_STORE=True: reading torchrun's store needs torch "
            f"({exc}); or set DSML_REGISTRY"
        ) from None
    host, port = store
    try:
        return TCPStore(
            host,
            port,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as exc:  # torch reports connection failures so
        raise RegistryUnavailableError(
            f"torchrun's agent store at {bracketed(host)}:{port} did not answer: {exc}"
        ) from None


def secret_for_store() -> str:
    """Before rank 0 serves the registry: the secret it will publish ("": none)."""
    return secret_to_publish("rank 0 of torchrun (through its store)")


async def publish_registry(
    store: tuple[str, int], key: str, address: str, secret: str, timeout_s: float
) -> None:
    """Set `key` to the registry's address in torchrun's store, `KEY/secret` to `secret`."""

    def publish() -> None:
        client = _client(store, timeout_s)
        client.set(f"{key}/secret", secret)
        client.set(key, address)  # last: a rank that sees the address finds the secret

    await asyncio.to_thread(publish)


async def lookup_registry(store: tuple[str, int], key: str, timeout_s: float) -> str:
    """Wait (at most timeout_s) until rank 0 published the registry; returns its address."""

    def lookup() -> str:
        client = _client(store, timeout_s)
        try:
            address = bytes(client.get(key)).decode()
            adopt_published(bytes(client.get(f"{key}/secret")).decode(), "torchrun's store")
            return address
        except (RuntimeError, OSError) as exc:  # torch's timeout is a RuntimeError subclass
            raise RegistryUnavailableError(
                f"rank 0 did not publish the registry's address in torchrun's store at "
                f"{store[0]}:{store[1]} within {timeout_s:g} s ({exc}): did rank 0 call "
                "dsml.init()?"
            ) from None

    return await asyncio.to_thread(lookup)
