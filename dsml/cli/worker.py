"""`dsml worker`: a long-running daemon that runs jobs sent by `dsml.Client` (cli layer)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from typing import Any

from ..daemon import WorkerConfig, WorkerDaemon
from ..errors import ConfigError, DsmlError, RegistryUnavailableError
from ..membership import query_status
from ..transport import Curve
from ..transport.addresses import loopback_bind
from .keys import add_curve_keys_option

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "worker",
        help="run a worker daemon that runs jobs sent by dsml.Client",
        description=(
            "Run a worker daemon: it is listed by the registry as idle, runs each job a "
            "dsml.Client sends it with a communicator over that job's workers, and sends "
            "back the result or the error. SIGTERM or Ctrl-C deregisters and exits 0; a "
            "second signal exits at once. A worker runs the code clients send it, so it "
            "binds loopback unless told otherwise, and any other address needs CURVE keys."
        ),
    )
    parser.add_argument(
        "--registry",
        help="the cluster's registry address",
    )
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    parser.add_argument("--name", default="", help="name shown by dsml status (default host-pid)")
    parser.add_argument(
        "--bind",
        default=None,
        help="address to serve jobs on (default: tcp://127.0.0.1:0, or tcp://[::1]:0 for an "
        "IPv6 registry); its host also carries the jobs' peer links. A non-loopback "
        "address requires --curve-keys",
    )
    add_curve_keys_option(
        parser,
        "CURVE keys made by `dsml keys generate DIR`: encrypt everything and run jobs only "
        "from clients whose public key is in DIR/authorized",
    )
    parser.add_argument(
        "--heartbeat-interval",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds between the daemon's hellos to the registry (default: %(default)s)",
    )
    parser.set_defaults(handler=_main)


def _main(args: argparse.Namespace) -> int:
    # The daemon's own log lines go to the real stderr (dsml.cli.main configures that): while
    # a job runs, sys.stderr is the job's output, forwarded to its client.
    try:
        config = _config(args)
    except ConfigError as exc:
        print(f"dsml worker: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(config))


def _config(args: argparse.Namespace) -> WorkerConfig:
    if not args.registry:
        raise ConfigError("no registry: pass --registry tcp://host:port or set DSML_REGISTRY")
    curve = Curve.load(args.curve_keys, role="server") if args.curve_keys else None
    return WorkerConfig(
        registry=args.registry,
        name=args.name,
        device=args.device,
        bind=args.bind or loopback_bind(args.registry),
        curve=curve,
        heartbeat_interval=args.heartbeat_interval,
    )


async def _serve(config: WorkerConfig) -> int:
    try:
        await query_status(config.registry, registry_timeout=5.0, curve=config.curve)
    except RegistryUnavailableError as exc:
        print(f"dsml worker: {exc}", file=sys.stderr)
        return 2
    try:
        daemon = await WorkerDaemon(config).start()
    except DsmlError as exc:
        print(f"dsml worker: {exc}", file=sys.stderr)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    signals = []

    def on_signal(signum: int, frame: object) -> None:
        # A Python-level handler, not loop.add_signal_handler: it runs even while a job's
        # plain function blocks the loop, so the second signal can always end the process.
        signals.append(signum)
        if len(signals) > 1:
            os._exit(128 + signum)
        loop.call_soon_threadsafe(stop.set)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    secure = ", CURVE" if config.curve is not None else ""
    print(
        f"dsml worker {daemon.name} serving on {daemon.address} "
        f"(registry {config.registry}, device {config.device}{secure})",
        flush=True,
    )
    await stop.wait()
    print(
        f"dsml worker {daemon.name} stopping after {daemon.jobs_done} jobs",
        file=sys.__stdout__,
        flush=True,
    )
    await daemon.aclose()
    return 0
