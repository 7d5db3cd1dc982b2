"""`dsml run -n N script.py`: start N ranks of a script (cli layer).

Without `--registry` an embedded registry runs inside the launcher, so one command starts a
whole job. Each rank gets DSML_REGISTRY, DSML_WORLD_SIZE and DSML_RANK (so `dsml.init()`
needs no arguments) and the variables torchrun users rely on. `--device cuda` adds
DSML_DEVICE, so rank i's `dsml.init()` takes GPU i modulo the GPU count.

Across hosts, as torchrun does: `dsml run -n K --nnodes N --node-rank I --registry
tcp://HOST:PORT script.py` on each of N hosts. Node 0's launcher serves the registry at
HOST:PORT and the launchers' link at PORT+1 (`nodes.py`); the world size is N*K and rank
I*K+local. With `--curve-keys DIR` the registry, the link and every rank's sockets use
CURVE with the keys of DIR.

A rank that fails on a dsml error prints a short report (its script's frames and the
message, `dsml/_report.py`); `--traceback` gives the ranks DSML_TRACEBACK=1, for Python's
full traceback. The launcher's root-cause summary comes last, after the ranks' output.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from typing import Any

from ..collectives.devices import parse_device, resolve_device
from ..config import CommConfig, RegistryConfig
from ..errors import ConfigError, DsmlError
from ..launch.launcher import Launch
from ..launch.node_board import NodeBoard
from ..launch.node_link import NodeLink
from ..launch.nodes import NodeShape, link_address
from ..launch.rank_setup import CPU_BIND
from ..membership import Registry, open_registry, query_status
from ..transport import Curve, check_address
from ..transport.addresses import bracketed, format_tcp, is_local_address, resolve_host, split_tcp
from .keys import add_curve_keys_option

log = logging.getLogger("dsml.run")

__all__ = ["add_parser", "launch", "launch_node"]

_NODE_WAIT_S = 300.0  # how long a node waits for node 0's launcher to answer


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
    if args.module is not None:  # -m takes the rest: the module's own options stay its own
        if not args.module:
            print("dsml run: -m needs a MODULE", file=sys.stderr)
            return 2
        module, *rest = args.module
        argv = [
            sys.executable,
            "-m",
            module,
            *rest,
            *([args.script] if args.script else []),  # only with -mMODULE written as one
            *args.args,
        ]
    elif args.script:
        argv = [sys.executable, args.script, *args.args]
    else:
        print("dsml run: give a SCRIPT (or -m MODULE)", file=sys.stderr)
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


def check_device(text: str | None) -> str | None:
    """Validate a --device flag here, once, rather than in every rank (ConfigError)."""
    if text is None:
        return None
    spec = parse_device(text)
    resolve_device(spec, 0)  # cupy installed, a GPU visible, cuda:N in range
    return str(spec)


def _curve(curve_keys: str | None) -> Curve | None:
    return Curve.load(curve_keys, role="server") if curve_keys else None


def _rank_env(curve_keys: str | None, traceback: bool) -> dict[str, str] | None:
    """What the ranks get besides this environment (None: nothing)."""
    extra = {"DSML_CURVE_KEYS": curve_keys} if curve_keys else {}
    if traceback:
        extra["DSML_TRACEBACK"] = "1"
    return dict(os.environ) | extra if extra else None


async def launch(
    argv: list[str],
    world_size: int,
    registry: str | None,
    *,
    grace_s: float = 5.0,
    curve_keys: str | None = None,
    traceback: bool = False,
    **options: Any,
) -> int:
    """Run argv as world_size ranks; an embedded registry when none is given."""
    curve = _curve(curve_keys)
    async with contextlib.AsyncExitStack() as stack:
        if registry is None:
            config = RegistryConfig(curve=curve)
            embedded = await stack.enter_async_context(open_registry(config=config))
            registry = embedded.address
        else:
            await check_running_group(registry, world_size, curve)
        launch = Launch(
            argv,
            world_size,
            registry,
            grace_s=grace_s,
            env=_rank_env(curve_keys, traceback),
            **options,
        )
        code = await launch.run()
        _print_outcome(launch)
        return code


def _print_outcome(launch: Launch) -> None:
    """The launcher's last word: what interrupted it, else the root cause of a failure."""
    if launch.interrupted:
        print(launch.interrupt_report(), file=sys.stderr, flush=True)
    elif launch.failure is not None:
        print(launch.failure.report(), file=sys.stderr, flush=True)


async def check_running_group(registry: str, world_size: int, curve: Any = None) -> None:
    """Refuse to start ranks for a group of another size than the registry's.

    A group whose ranks all ended may still be listed until the registry's heartbeat
    timeout evicts the last of them (a rank stopped while it was leaving), so a group of
    another size is waited out while none of its members heartbeats, for up to that
    timeout; one heartbeat, or the timeout passed, and the launch is refused.

    Raises:
        ConfigError: a group of another world size is running or forming there.
    """
    loop = asyncio.get_running_loop()
    seen: dict[Any, Any] | None = None  # heartbeats counted per member at the first look
    deadline = None
    while True:
        try:
            status = await query_status(registry, registry_timeout=2.0, curve=curve)
        except DsmlError as exc:
            # Maybe not up yet: the ranks wait for it and fail if it never comes. Say so
            # now, not only when they give up.
            log.warning(
                "%s. The ranks wait for it up to their registry timeout (%g s by default); "
                "or %s to run one in this launcher",
                str(exc).rstrip("."),
                CommConfig().registry_timeout,
                # exported, it is --registry's default: leaving the flag out is not enough
                "unset DSML_REGISTRY and leave --registry out"
                if os.environ.get("DSML_REGISTRY")
                else "leave --registry out",
            )
            return
        size = status.get("world_size")
        if not (type(size) is int and size and size != world_size):
            return
        beats = {m.get("rank"): m.get("heartbeats") for m in status.get("members") or []}
        if seen is None:
            seen = beats
            timeout = status.get("heartbeat_timeout")
            wait_s = float(timeout) + 0.5 if isinstance(timeout, int | float) else 0.0
            deadline = loop.time() + wait_s
        alive = any(seen.get(rank) != count for rank, count in beats.items())
        if not status.get("formed") or alive or loop.time() >= (deadline or 0.0):
            state = "running" if status.get("formed") else "forming"
            raise ConfigError(
                f"the registry at {registry} has a group of world size {size} "
                f"{state}, but this launch would start ranks of a group of {world_size}: "
                "start every launch of one job with the same -n (and --nnodes)"
            )
        await asyncio.sleep(0.1)


async def launch_node(
    argv: list[str],
    shape: NodeShape,
    registry: str,
    *,
    grace_s: float = 5.0,
    curve_keys: str | None = None,
    traceback: bool = False,
    **options: Any,
) -> int:
    """One node's part of a multi-node run (see the module docstring)."""
    curve = _curve(curve_keys)
    link = link_address(registry)
    launch = Launch(
        argv,
        shape.world_size,
        registry,
        grace_s=grace_s,
        ranks=shape.ranks,
        node=shape.node_rank,
        env=_rank_env(curve_keys, traceback),
        **options,
    )
    async with contextlib.AsyncExitStack() as stack:
        if shape.node_rank == 0:
            served = await stack.enter_async_context(_serve_registry(registry, curve))
            board = NodeBoard(shape, launch.add_remote_failure).open(
                node_zero_bind(link), curve=curve
            )
            stack.push_async_callback(board.aclose)
            launch.on_failure = board.report
            await launch.run()
            await board.wait_nodes_done(lambda: _group_gone(served), grace_s)
            board.farewell(launch.exit_code())
            await asyncio.sleep(0.1)  # on its way before the link closes
        else:
            print(
                f"dsml run: node {shape.node_rank}: waiting for node 0's launcher at {link} "
                f"(up to {_NODE_WAIT_S:g} s)",
                file=sys.stderr,
                flush=True,
            )
            node = await NodeLink(shape, launch.add_remote_failure).open(
                link, timeout_s=_NODE_WAIT_S, curve=curve
            )
            stack.push_async_callback(node.aclose)
            launch.on_failure = node.report
            await node.done(await launch.run())
            await asyncio.sleep(0.1)  # a last relayed report may be on its way
        _print_outcome(launch)
        return launch.exit_code()


def _group_gone(registry: Registry) -> bool:
    status = registry.status()
    return not status["members"] and not status["joining"]


def node_zero_bind(address: str) -> str:
    """Node 0 binds the address it was told it serves: HOST must be this machine."""
    host, port = split_tcp(address, "--registry")
    ip = resolve_host(host, "--registry")
    if not is_local_address(ip):
        raise ConfigError(
            f"node 0 serves the registry at --registry {address}, but {bracketed(host)} "
            f"({bracketed(ip)}) is not an address of this host: run --node-rank 0 on "
            f"{bracketed(host)}"
        )
    return format_tcp(ip, port)


@contextlib.asynccontextmanager
async def _serve_registry(address: str, curve: Any) -> Any:
    config = RegistryConfig(address=node_zero_bind(address), curve=curve)
    async with open_registry(config=config) as registry:
        yield registry
