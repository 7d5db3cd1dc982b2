"""`dsml run -n N script.py`: start N ranks of a script (cli layer).

Without `--registry` an embedded registry runs inside the launcher, so one command starts a
whole job. Each rank gets DSML_REGISTRY, DSML_WORLD_SIZE and DSML_RANK (so `dsml.init()`
needs no arguments) and the variables torchrun users rely on. `--device cuda` adds
DSML_DEVICE, so rank i's `dsml.init()` takes GPU i modulo the GPU count.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from typing import Any

from ..collectives.devices import parse_device, resolve_device
from ..membership import open_registry
from .launcher import Launch

__all__ = ["add_parser", "launch"]


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "run",
        help="start N ranks of a Python script",
        description="Start N processes running SCRIPT, each a rank of one group.",
    )
    parser.add_argument("-n", "--nprocs", type=int, required=True, help="number of ranks")
    parser.add_argument("--registry", help="an existing registry (default: start one here)")
    parser.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="seconds the other ranks get to exit after one fails (default: %(default)s)",
    )
    parser.add_argument(
        "--device",
        help="cpu, cuda (rank i gets GPU i modulo the GPU count) or cuda:N; sets DSML_DEVICE",
    )
    parser.add_argument("-m", dest="module", help="run a module (like python -m) instead")
    parser.add_argument("script", nargs="?", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(handler=_main)


def _main(args: argparse.Namespace) -> int:
    if args.nprocs < 1:
        print("dsml run: -n must be at least 1", file=sys.stderr)
        return 2
    if args.module:
        argv = [
            sys.executable,
            "-m",
            args.module,
            *([args.script] if args.script else []),
            *args.args,
        ]
    elif args.script:
        argv = [sys.executable, args.script, *args.args]
    else:
        print("dsml run: give a SCRIPT (or -m MODULE)", file=sys.stderr)
        return 2
    device = check_device(args.device)
    return asyncio.run(launch(argv, args.nprocs, args.registry, grace_s=args.grace, device=device))


def check_device(text: str | None) -> str | None:
    """Validate a --device flag here, once, rather than in every rank (ConfigError)."""
    if text is None:
        return None
    spec = parse_device(text)
    resolve_device(spec, 0)  # cupy installed, a GPU visible, cuda:N in range
    return str(spec)


async def launch(
    argv: list[str],
    world_size: int,
    registry: str | None,
    *,
    grace_s: float = 5.0,
    **options: Any,
) -> int:
    """Run argv as world_size ranks; an embedded registry when none is given."""
    async with contextlib.AsyncExitStack() as stack:
        if registry is None:
            embedded = await stack.enter_async_context(open_registry())
            registry = embedded.address
        launch = Launch(argv, world_size, registry, grace_s=grace_s, **options)
        code = await launch.run()
        if launch.failure is not None:
            print(launch.failure.report(), file=sys.stderr, flush=True)
        return code
