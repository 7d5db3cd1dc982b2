"""`dsml registry`: run a registry until interrupted (cli layer)."""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Any

from ..config import RegistryConfig
from ..membership import open_registry

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "registry",
        help="run a registry that forms groups of workers",
        description="Run a registry: workers join it with dsml.init(ADDRESS, world_size=N).",
    )
    parser.add_argument(
        "--address",
        default="tcp://127.0.0.1:5555",
        help="address to bind (default: %(default)s; port 0 picks a free port)",
    )
    parser.set_defaults(handler=_main)


def _main(args: argparse.Namespace) -> int:
    return asyncio.run(_serve(RegistryConfig(address=args.address)))


async def _serve(config: RegistryConfig) -> int:
    async with open_registry(config=config) as registry:
        print(f"dsml registry serving on {registry.address}", flush=True)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        print(f"dsml registry stopping ({registry.dropped_messages} malformed messages dropped)")
    return 0
