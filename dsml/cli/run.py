"""`dsml run -n N script.py`: start N ranks of a script (cli layer).

Without `--registry` an embedded registry runs inside the launcher, so one command starts a
whole job. Each rank gets DSML_REGISTRY, DSML_WORLD_SIZE and DSML_RANK (so `dsml.init()`
needs no arguments) and the variables torchrun users rely on. `--device cuda` adds
DSML_DEVICE, so rank i's `dsml.init()` takes GPU i modulo the GPU count.

Across hosts, as torchrun does: `dsml run -n K --nnodes N --node-rank I --registry
tcp://HOST:PORT script.py` on each of N hosts. Node 0's launcher serves the registry at
HOST:PORT and the launchers' link at PORT+1; the world size is N*K and rank I*K+local.
With `--curve-keys DIR` the registry, the link and every rank's sockets use CURVE with
the keys of DIR.

A rank that fails on a dsml error prints a short report (its script's frames and the
message, `dsml/_report.py`); `--traceback` gives the ranks DSML_TRACEBACK=1, for Python's
full traceback. The launcher's root-cause summary comes last, after the ranks' output.

This module reads the flags; the job itself runs in `dsml/launch/job.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from ..collectives.devices import parse_device, resolve_device
from ..launch.job import launch, launch_node
from ..launch.nodes import NodeShape
from ..launch.rank_setup import CPU_BIND
from ..transport import check_address
from .keys import add_curve_keys_option

__all__ = ["add_parser", "check_device"]


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "run",
        help="start N ranks of a Python script",
        description="Start N processes running SCRIPT, each a rank of one group.",
    )
    parser.add_argument("-n", "--nprocs", type=int, required=True, help="ranks (per node)")
    parser.add_argument(
        "--registry",
        help="an existing registry (default: start one here); with --nnodes, where node 0 "
        "serves it (tcp://HOST:PORT, HOST being node 0)",
    )
    parser.add_argument(
        "--nnodes", type=int, help="hosts taking part, each running this command (default 1)"
    )
    parser.add_argument(
        "--node-rank", type=int, default=0, help="this host's index, 0..nnodes-1 (default 0)"
    )
    add_curve_keys_option(
        parser,
        "a `dsml keys generate` folder: CURVE for the registry, the launchers' link and "
        "every rank (sets DSML_CURVE_KEYS)",
    )
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
    parser.add_argument(
        "--cpu-bind",
        choices=CPU_BIND,
        default="auto",
        help="auto: with more ranks than CPUs, bind rank i to CPU i modulo their number; "
        "spread: also give each of fewer ranks its own block of CPUs; none: never bind "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--traceback",
        action="store_true",
        help="ranks print Python's full traceback of a dsml error, dsml's own frames "
        "included, instead of a short report (sets DSML_TRACEBACK=1)",
    )
    parser.add_argument(
        "-m",
        dest="module",
        nargs=argparse.REMAINDER,
        metavar="MODULE [ARGS]",
        help="run a module (like python -m) instead; everything after MODULE is its own",
    )
    parser.add_argument("script", nargs="?", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(handler=_main)


def _main(args: argparse.Namespace) -> int:
    if args.nprocs < 1:
        print("dsml run: -n must be at least 1", file=sys.stderr)
        return 2
    if args.grace < 0:
        print("dsml run: --grace must be 0 or more seconds", file=sys.stderr)
        return 2
    if args.registry is not None:  # before any rank starts, not once per rank
        check_address(args.registry, "--registry")
    argv = _rank_argv(args)
    if argv is None:
        return 2
    device = check_device(args.device)
    options: dict[str, Any] = {"grace_s": args.grace, "device": device, "cpu_bind": args.cpu_bind}
    if args.curve_keys:
        options["curve_keys"] = args.curve_keys
    if args.traceback:
        options["traceback"] = True
    if args.nnodes is None:
        if args.node_rank != 0:
            print("dsml run: --node-rank needs --nnodes", file=sys.stderr)
            return 2
        return asyncio.run(launch(argv, args.nprocs, args.registry, **options))
    if args.registry is None:
        print("dsml run: --nnodes needs --registry tcp://HOST:PORT (node 0)", file=sys.stderr)
        return 2
    shape = NodeShape(args.nnodes, args.nprocs, args.node_rank)
    return asyncio.run(launch_node(argv, shape, args.registry, **options))


def _rank_argv(args: argparse.Namespace) -> list[str] | None:
    """The command each rank runs; None (after saying why) when there is none."""
    if args.module is not None:  # -m takes the rest: the module's own options stay its own
        if not args.module:
            print("dsml run: -m needs a MODULE", file=sys.stderr)
            return None
        module, *rest = args.module
        return [
            sys.executable,
            "-m",
            module,
            *rest,
            *([args.script] if args.script else []),  # only with -mMODULE written as one
            *args.args,
        ]
    if args.script:
        return [sys.executable, args.script, *args.args]
    print("dsml run: give a SCRIPT (or -m MODULE)", file=sys.stderr)
    return None


def check_device(text: str | None) -> str | None:
    """Validate a --device flag here, once, rather than in every rank (ConfigError)."""
    if text is None:
        return None
    spec = parse_device(text)
    resolve_device(spec, 0)  # cupy installed, a GPU visible, cuda:N in range
    return str(spec)
