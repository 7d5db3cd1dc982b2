"""`dsml registry`: run a registry until interrupted (cli layer)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import Any

from ..config import RegistryConfig
from ..errors import ConfigError
from ..membership import open_registry
from ..transport import Curve, job_secret
from .keys import add_curve_keys_option

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
    defaults = RegistryConfig()
    parser.add_argument(
        "--heartbeat-interval",
        type=float,
        default=defaults.heartbeat_interval,
        metavar="S",
        help="seconds between a worker's heartbeats (default: %(default)s)",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=defaults.heartbeat_timeout,
        metavar="S",
        help="a worker silent this long is declared dead; must exceed twice the interval "
        "(default: %(default)s). A killed worker is found sooner, by its peers.",
    )
    add_curve_keys_option(
        parser,
        "CURVE keys made by `dsml keys generate DIR`: encrypt everything and hear only keys "
        "allowlisted in DIR/authorized",
    )
    parser.set_defaults(handler=_main)


def _secret_line() -> str:
    """Which secret the registry admits, and how the job's other processes get it."""
    secret = job_secret()
    return (
        f"admitting connections that prove the {secret}: give the job's other processes "
        f"the same secret (DSML_SECRET, DSML_SECRET_FILE or --secret-file)"
    )


def _main(args: argparse.Namespace) -> int:
    try:
        config = RegistryConfig(
            address=args.address,
            heartbeat_interval=args.heartbeat_interval,
            heartbeat_timeout=args.heartbeat_timeout,
            curve=Curve.load(args.curve_keys, role="server") if args.curve_keys else None,
        )
        if config.curve is None:
            job_secret()  # a missing or unreadable secret is said before anything binds
    except ConfigError as exc:
        print(f"dsml registry: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(config))


async def _serve(config: RegistryConfig) -> int:
    async with open_registry(config=config) as registry:
        print(f"dsml registry serving on {registry.address}", flush=True)
        if config.curve is None:
            print(_secret_line(), flush=True)
        print(
            f"heartbeats every {config.heartbeat_interval:g} s; a member silent for "
            f"{config.heartbeat_timeout:g} s is declared dead"
            f"{'; CURVE on' if config.curve is not None else ''}",
            flush=True,
        )
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        print(f"dsml registry stopping ({registry.dropped_messages} malformed messages dropped)")
    return 0
