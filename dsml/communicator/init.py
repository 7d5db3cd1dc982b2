"""`dsml.init`: join a group through the registry and return a communicator (communicator).

This is an edge: it resolves explicit arguments over `DSML_*` environment variables over
defaults, once, and hands frozen configuration inward.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import socket
from collections.abc import Mapping

from .._opener import Opener
from ..collectives.devices import DeviceSpec, parse_device, resolve_device
from ..config import CommConfig, env_float, env_int, environ
from ..errors import ConfigError, DsmlError
from ..membership import Member, RegistryClient
from ..transport import check_address
from ..transport.addresses import advertised
from .communicator import Communicator
from .links import PeerLinks
from .tasks import TaskOwner

__all__ = ["init"]


@dataclasses.dataclass(frozen=True, slots=True)
class _JoinArgs:
    registry: str
    world_size: int
    rank: int | None
    name: str
    config: CommConfig
    device: DeviceSpec
    local_rank: int | None  # picks the GPU of device="cuda" (else the rank does)


def _resolve(
    address: str | None,
    world_size: int | None,
    rank: int | None,
    name: str | None,
    timeout: float | None,
    config: CommConfig | None,
    device: str | None,
    env: Mapping[str, str],
) -> _JoinArgs:
    registry = address or env.get("DSML_REGISTRY", "").strip() or None
    if registry is None:
        raise ConfigError(
            "no registry address: call dsml.init('tcp://host:port', world_size=N), set "
            "DSML_REGISTRY, or start the script with `dsml run -n N script.py`"
        )
    check_address(registry, "registry address")
    size = world_size if world_size is not None else env_int(env, "DSML_WORLD_SIZE")
    if type(size) is not int or size < 1:
        raise ConfigError(
            f"world_size must be a positive integer (argument or DSML_WORLD_SIZE), got {size!r}"
        )
    rank = rank if rank is not None else env_int(env, "DSML_RANK")
    if rank is not None and not 0 <= rank < size:
        raise ConfigError(f"rank={rank} is out of range for world_size={size}")
    spec = parse_device(device if device is not None else env.get("DSML_DEVICE") or None)
    local_rank = env_int(env, "LOCAL_RANK")
    local_rank = local_rank if local_rank is not None else env_int(env, "DSML_LOCAL_RANK")
    if spec.is_cuda:  # fail before joining: cupy missing, no GPU, no such GPU
        resolve_device(spec, local_rank if local_rank is not None else rank)
    config = config or CommConfig()
    timeout = timeout if timeout is not None else env_float(env, "DSML_TIMEOUT")
    if timeout is not None:
        config = dataclasses.replace(config, timeout=timeout)
    bind = env.get("DSML_BIND", "").strip()
    if bind and config.bind == CommConfig().bind:
        config = dataclasses.replace(config, bind=bind)
    name = name if name is not None else env.get("DSML_NAME", "")
    return _JoinArgs(registry, size, rank, name, config, spec, local_rank)


async def _join(args: _JoinArgs) -> Communicator:
    """Construct the parts (no I/O), bind, join through the registry, then open."""
    loop = asyncio.get_running_loop()
    member_id = secrets.token_hex(8)
    tasks = TaskOwner()
    links = PeerLinks(member_id, args.config, tasks)
    address = advertised(links.bind(), toward=args.registry)
    member = Member(member_id, address, args.name, socket.gethostname(), os.getpid())
    registry = RegistryClient(args.registry, member, args.config)
    try:
        registry.open()
        view = await registry.join(args.world_size, args.rank)
        rank = view.rank_of(member_id)
        assert rank is not None, "the registry's view must contain the member that joined"
        comm = Communicator(links, tasks, registry, args.config, loop, _place(args, rank))
        comm.open(view)
    except BaseException:  # clean up, then re-raise
        with contextlib.suppress(DsmlError):
            await registry.leave()  # the registry must not keep a member that is not coming
        await registry.aclose()
        await tasks.cancel_all()
        await links.aclose()
        raise
    return comm


def _place(args: _JoinArgs, rank: int) -> str:
    """The communicator's device; a CUDA one becomes this thread's current device."""
    local_rank = args.local_rank if args.local_rank is not None else rank
    device = resolve_device(args.device, local_rank)
    if device != "cpu":
        from ..collectives import cuda  # cupy only when CUDA is asked for

        cuda.use_device(int(device.split(":")[1]))
    return device


def init(
    address: str | None = None,
    world_size: int | None = None,
    *,
    rank: int | None = None,
    name: str | None = None,
    timeout: float | None = None,
    config: CommConfig | None = None,
    device: str | None = None,
) -> Opener[Communicator]:
    """Join the group of the registry at `address` and return this worker's communicator.

    Args:
        address: the registry (default: `DSML_REGISTRY`, set by `dsml run`).
        world_size: members the group needs before it forms (default: `DSML_WORLD_SIZE`).
        rank: ask for this rank (default: `DSML_RANK` if set, else the join order).
        name: a label shown by status tools.
        timeout: default seconds a collective may take (default: `DSML_TIMEOUT`, else 120).
        config: all other settings (`CommConfig`).
        device: "cpu", "cuda:N", or "cuda" for GPU `LOCAL_RANK % gpu count` (LOCAL_RANK,
            else DSML_LOCAL_RANK, else the rank); default `DSML_DEVICE`, else "cpu". A
            CUDA device becomes the calling thread's current device, and arrays made
            without an input (`recv`, `scatter` on non-roots) are cupy arrays there.

    Use `async with dsml.init(...) as comm:` or `comm = await dsml.init(...)` followed by
    `await comm.aclose()`.

    Raises:
        ConfigError: missing or invalid arguments, the registry refused this worker, or a
            CUDA device was asked for without cupy or without a GPU.
        RegistryUnavailableError: no registry answered at the address.
        JoinTimeoutError: the group did not form within `config.join_timeout`.
    """
    args = _resolve(address, world_size, rank, name, timeout, config, device, environ())

    async def open_communicator() -> Communicator:
        return await _join(args)

    return Opener(open_communicator)
