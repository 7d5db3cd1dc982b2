"""`dsml.init`: join a group through the registry and return a communicator (communicator).

This is an edge: it resolves explicit arguments over `DSML_*` environment variables over
defaults, once, and hands frozen configuration inward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import socket
from collections.abc import Mapping

from .. import _report
from .._opener import Opener
from ..collectives.devices import DeviceSpec, parse_device, resolve_device
from ..config import CommConfig, env_float, environ
from ..errors import ConfigError, DsmlError
from ..launch import Rendezvous, choose_bind, find_registry, resolve_rendezvous
from ..launch.join import running_world_size
from ..membership import Member, RegistryClient
from ..transport import Curve, check_peers_fit
from ..transport.addresses import advertised
from ..transport.shm_segment import host_identity
from .communicator import Communicator
from .lifecycle import open_root
from .links import PeerLinks
from .tasks import TaskOwner

__all__ = ["init", "init_or_join"]


@dataclasses.dataclass(frozen=True, slots=True)
class _JoinArgs:
    plan: Rendezvous  # registry, world size, rank, local rank, who serves the registry
    name: str
    config: CommConfig
    device: DeviceSpec
    bind: str | None  # CommConfig.bind or DSML_BIND when given; else chosen at join
    ifname: str | None  # DSML_IFNAME
    join_running: bool = False  # joins a running group whatever world_size says


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
    plan = resolve_rendezvous(address, world_size, rank, env)
    spec = parse_device(device if device is not None else env.get("DSML_DEVICE") or None)
    if spec.is_cuda:  # fail before joining: cupy missing, no GPU, no such GPU
        resolve_device(spec, plan.local_rank if plan.local_rank is not None else plan.rank)
    config = config or CommConfig()
    timeout = timeout if timeout is not None else env_float(env, "DSML_TIMEOUT")
    if timeout is not None:
        config = dataclasses.replace(config, timeout=timeout)
    progress_after = env_float(env, "DSML_PROGRESS_AFTER")
    if progress_after is not None and config.progress_after == CommConfig().progress_after:
        config = dataclasses.replace(config, progress_after=progress_after)
    keys = env.get("DSML_CURVE_KEYS", "").strip()
    if keys and config.curve is None:
        config = dataclasses.replace(config, curve=Curve.load(keys, role="server"))
    bind = config.bind if config.bind != CommConfig().bind else None
    bind = bind or env.get("DSML_BIND", "").strip() or None
    ifname = env.get("DSML_IFNAME", "").strip() or None
    name = name if name is not None else env.get("DSML_NAME", "")
    shm = env.get("DSML_SHM", "").strip().lower()
    if shm in ("0", "false", "no", "off") and config.shm:
        config = dataclasses.replace(config, shm=False)
    elif shm in ("1", "true", "yes", "on") and not config.shm:
        config = dataclasses.replace(config, shm=True)
    elif shm not in ("", "0", "false", "no", "off", "1", "true", "yes", "on"):
        raise ConfigError(f"DSML_SHM={env['DSML_SHM']!r}: use 1 (on, the default) or 0 (off)")
    flight_dir = env.get("DSML_FLIGHT_DIR", "").strip()
    if flight_dir and config.flight_dir is None:
        config = dataclasses.replace(config, flight_dir=flight_dir)
    return _JoinArgs(plan, name, config, spec, bind, ifname)


async def _join(args: _JoinArgs) -> Communicator:
    timeout_s = args.config.join_timeout
    address, hosted = await find_registry(
        args.plan, ifname=args.ifname, curve=args.config.curve, timeout_s=timeout_s
    )
    try:
        comm = await _join_group(args, address)
    except BaseException:
        if hosted is not None:
            await hosted.aclose()
        raise
    if hosted is not None:
        comm.on_close(hosted.aclose)  # the group's registry lives as long as rank 0's comm
    return comm


async def _join_group(args: _JoinArgs, registry_address: str) -> Communicator:
    config = dataclasses.replace(
        args.config, bind=choose_bind(args.bind, args.ifname, registry_address)
    )
    if args.plan.rank0_serves:  # rank 0 may still be starting: its join request waits
        patience = max(config.registry_timeout, config.join_timeout)
        config = dataclasses.replace(config, registry_timeout=patience)
    member_id = secrets.token_hex(8)
    tasks = TaskOwner()
    links = PeerLinks(member_id, config, tasks)  # constructing does no I/O ...
    address = advertised(links.bind(), toward=registry_address)  # ... binding does
    host_id = host_identity() if config.shm else ""  # empty: no shared memory with us
    member = Member(
        member_id,
        address,
        args.name,
        socket.gethostname(),
        os.getpid(),
        host_id,
        config.max_frame_bytes,
    )
    registry = RegistryClient(registry_address, member, config)
    try:
        registry.open()
        size, running = args.plan.world_size, args.join_running
        if size is None:
            size, running = await running_world_size(registry), True
        view = await registry.join(size, args.plan.rank, running=running)
        check_peers_fit(view.size - 1)  # a clear ConfigError on every rank, not EMFILE later
        rank = view.rank_of(member_id)
        assert rank is not None, "the registry's view must contain the member that joined"
        # installs the view, listens to the registry, starts heartbeats
        comm = open_root(links, tasks, registry, config, _place(args, rank), view)
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
    local_rank = args.plan.local_rank if args.plan.local_rank is not None else rank
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
        address: the registry (default: `DSML_REGISTRY`, set by `dsml run`; else the
            launcher's rendezvous, where its rank-0 process serves the registry: torchrun,
            srun, mpirun with MASTER_ADDR/MASTER_PORT; see `dsml.launch`).
        world_size: members the group needs before it forms (default: `DSML_WORLD_SIZE`,
            else the launcher's). A group already running there admits the worker only
            while it has fewer members; else the worker waits for it to end and forms the
            next (a registry forms one group at a time: a second job is never merged into
            the first). Without one, join the group running at `address` (at its next
            collective boundary).
        rank: ask for this rank (default: `DSML_RANK`, else the launcher's rank, else the
            join order).
        name: a label shown by status tools.
        timeout: default seconds a collective may take (default: `DSML_TIMEOUT`, else 120).
        config: all other settings (`CommConfig`).
        device: "cpu", "cuda:N", or "cuda" for GPU `local rank % gpu count` (DSML_LOCAL_RANK,
            else the launcher's local rank, else the rank); default `DSML_DEVICE`, else "cpu". A
            CUDA device becomes the calling thread's current device, and arrays made
            without an input (`recv`, `scatter` on non-roots) are cupy arrays there.

    Each setting is resolved once: arguments > `DSML_*` variables > the launcher's
    variables. The worker binds `config.bind` or `DSML_BIND` if given, else the interface
    `DSML_IFNAME` names, else the interface that routes to a registry on another host,
    else loopback.

    Use `async with dsml.init(...) as comm:` or `comm = await dsml.init(...)` followed by
    `await comm.aclose()`.

    Raises:
        ConfigError: missing or invalid arguments, the registry refused this worker, or a
            CUDA device was asked for without cupy or without a GPU.
        RegistryUnavailableError: no registry answered at the address.
        JoinTimeoutError: the group did not form within `config.join_timeout`.
    """
    _report.install(environ())  # short reports of dsml errors, unless the program has a hook
    args = _resolve(address, world_size, rank, name, timeout, config, device, environ())
    return _opener(args)


def init_or_join(
    address: str | None, world_size: int | None, *, config: CommConfig | None, name: str | None
) -> Opener[Communicator]:
    """`init`, but where a group already runs at the registry, join it whatever its size
    (`dsml.elastic`: `world_size` only forms a new group). With `init`, a worker whose
    `world_size` the running group already has waits for the next group, so that a second
    job pointed at a busy registry is not merged into the first."""
    _report.install(environ())
    args = _resolve(address, world_size, None, name, None, config, None, environ())
    return _opener(dataclasses.replace(args, join_running=True))


def _opener(args: _JoinArgs) -> Opener[Communicator]:
    async def open_communicator() -> Communicator:
        return await _join(args)

    return Opener(open_communicator, "dsml.init")
