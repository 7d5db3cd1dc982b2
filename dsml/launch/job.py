"""One `dsml run` job: its registry, its launcher and, across hosts, the link (launch layer).

`launch` runs one host's ranks, with a registry embedded in the launcher unless one is
given (then it first checks that no group of another size runs there). `launch_node` is
one host's part of `dsml run --nnodes N`: node 0's launcher serves the registry at
--registry's HOST:PORT and the launchers' link at PORT+1 (`node_board.py`), every other
node's connects to it (`node_link.py`); the world size is N*K and rank I*K+local. With
CURVE keys the registry, the link and every rank's sockets use CURVE with those keys.

The job secret: a launch with its own embedded registry makes a fresh one for the job
unless the environment names one, and hands it to its ranks in `DSML_SECRET`. A launch
that joins a registry given by --registry, and every node of a multi-node run, use the
secret the environment names (or the per-user file): the nodes' link authenticates with
it too, so it cannot be handed over that link.

The launcher's root-cause summary comes last, after the ranks' output.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from typing import Any

from ..config import CommConfig, RegistryConfig
from ..errors import ConfigError, DsmlError
from ..membership import Registry, open_registry, query_status
from ..transport import Curve
from ..transport.addresses import bracketed, format_tcp, is_local_address, resolve_host, split_tcp
from ..transport.secret import adopt_secret, explicit_secret, make_secret
from .launcher import Launch
from .node_board import NodeBoard
from .node_link import NodeLink
from .nodes import NodeShape, link_address

log = logging.getLogger("dsml.run")

__all__ = ["check_running_group", "launch", "launch_node", "node_zero_bind"]

_NODE_WAIT_S = 300.0  # how long a node waits for node 0's launcher to answer


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
            if curve is None and not explicit_secret():
                adopt_secret(make_secret(), "dsml run (made for this job)")
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
            await _run_node_zero(stack, launch, shape, registry, curve, grace_s)
        else:
            await _run_other_node(stack, launch, shape, link, curve)
        _print_outcome(launch)
        return launch.exit_code()


async def _run_node_zero(
    stack: contextlib.AsyncExitStack,
    launch: Launch,
    shape: NodeShape,
    registry: str,
    curve: Curve | None,
    grace_s: float,
) -> None:
    """Serve the registry and the link, run node 0's ranks, wait for the other nodes."""
    served = await stack.enter_async_context(_serve_registry(registry, curve))
    board = NodeBoard(shape, launch.add_remote_failure).open(
        node_zero_bind(link_address(registry)), curve=curve
    )
    stack.push_async_callback(board.aclose)
    launch.on_failure = board.report
    await launch.run()
    await board.wait_nodes_done(lambda: _group_gone(served), grace_s)
    board.farewell(launch.exit_code())
    await asyncio.sleep(0.1)  # on its way before the link closes


async def _run_other_node(
    stack: contextlib.AsyncExitStack,
    launch: Launch,
    shape: NodeShape,
    link: str,
    curve: Curve | None,
) -> None:
    """Be welcomed by node 0's launcher, then run this node's ranks."""
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
