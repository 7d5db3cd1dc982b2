"""Elastic training: state that survives members dying and joining (above the communicator).

`State` holds a job's arrays (numpy) and small values (anything msgpack can carry: numbers,
strings, lists, dicts; map keys str, int, float, bool or None) with a committed copy. The
names of State's own attributes (commit, commits, names, restore, sync) are refused:

    state = dsml.elastic.State(params=np.zeros(10), step=0)
    state.params += 1; state.step += 1
    state.commit()            # the state to go back to if this step fails
    state.restore()           # back to the last commit
    await state.sync(comm)    # everyone takes the committed state of rank 0

`await dsml.elastic.run(fn, state, registry=..., min_size=...)` joins the group, syncs and
calls `await fn(comm, state)`. When a member is lost (`PeerLostError`) or the group grows
(members joined), every member restores its last commit, waits for the new view, syncs and
calls `fn` again, so joiners receive the state and start from it. `fn` must therefore be
written to continue from whatever state it is given (typically: loop while
`state.step < steps`, commit after each step).

Which state wins a sync: the committed state of rank 0 of the new view. Ranks keep ring
order across views and joiners come last, so rank 0 is always among the members that have
been in the group longest; its last commit is a state every survivor has reached or is
about to reach again (a collective that failed on one rank and finished on another leaves
them at most one commit apart; the sync makes them equal).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgpack
import numpy as np

from .communicator import Communicator
from .communicator.init import init_or_join
from .config import CommConfig, env_int, environ
from .errors import (
    ConfigError,
    DsmlError,
    EvictedError,
    MemberLeftError,
    MembershipChangedError,
    NoQuorumError,
    PeerLostError,
)

__all__ = ["BelowMinSizeError", "State", "run"]

log = logging.getLogger("dsml.elastic")

T = TypeVar("T")
_MAX_HEADER = 16 << 20
#: attribute names of State itself, refused as value names (they would be shadowed)
_RESERVED = ("commit", "commits", "names", "restore", "sync")


class BelowMinSizeError(DsmlError, TimeoutError):
    """The group stayed smaller than `min_size` for longer than allowed."""


class State:
    """Arrays and msgpack-able values with a committed copy; see the module docstring."""

    def __init__(self, **values: Any) -> None:
        object.__setattr__(self, "_values", {})
        object.__setattr__(self, "_committed", {})
        object.__setattr__(self, "commits", 0)
        for name, value in values.items():
            setattr(self, name, value)
        self.commit()
        object.__setattr__(self, "commits", 0)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(f"State has no value {name!r} (it has {sorted(values)})")

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            raise ConfigError(f"State value names may not start with '_': {name!r}")
        if name in _RESERVED:
            raise ConfigError(
                f"State value name {name!r} is taken by State itself ({', '.join(_RESERVED)})"
            )
        if not isinstance(value, np.ndarray):
            try:  # what sync sends must come back: map keys only str, int, float, bool, None
                msgpack.unpackb(msgpack.packb(value), strict_map_key=False)
            except (TypeError, ValueError, OverflowError) as exc:
                raise ConfigError(
                    f"State value {name!r} must be a numpy array or msgpack-able (numbers, "
                    f"strings, lists, dicts): {exc}"
                ) from None
        self._values[name] = value

    def names(self) -> list[str]:
        return sorted(self._values)

    def commit(self) -> None:
        """Remember the current values as the state to return to after a failure."""
        object.__setattr__(self, "_committed", _copy(self._values))
        object.__setattr__(self, "commits", self.commits + 1)

    def restore(self) -> None:
        """Go back to the last committed values (arrays are restored in place when their
        shape and dtype allow, so references held elsewhere see the restored data)."""
        for name, value in self._committed.items():
            current = self._values.get(name)
            if (
                isinstance(value, np.ndarray)
                and isinstance(current, np.ndarray)
                and current.shape == value.shape
                and current.dtype == value.dtype
                and current.flags.writeable
            ):
                current[...] = value
            else:
                self._values[name] = copy.deepcopy(value)

    async def sync(self, comm: Communicator, root: int = 0) -> None:
        """Make every member's state the committed state of `root` (a collective call:
        every member must call it). Arrays must have the same names, shapes and dtypes
        everywhere; values may differ and are replaced."""
        committed = self._committed
        arrays = sorted(n for n, v in committed.items() if isinstance(v, np.ndarray))
        if comm.rank == root:
            header = msgpack.packb(
                {
                    "commits": self.commits,
                    "values": {n: v for n, v in committed.items() if n not in arrays},
                    "arrays": arrays,
                }
            )
            size = np.array([len(header)], dtype=np.int64)
        else:
            size = np.zeros(1, dtype=np.int64)
        await comm.broadcast(size, root)
        if not 0 < int(size[0]) <= _MAX_HEADER:
            raise ConfigError(f"State.sync: the root's header has {int(size[0])} bytes")
        if comm.rank == root:
            raw = np.frombuffer(header, dtype=np.uint8).copy()
        else:
            raw = np.zeros(int(size[0]), dtype=np.uint8)
        await comm.broadcast(raw, root)
        meta = msgpack.unpackb(raw.tobytes(), strict_map_key=False)
        # Every member learns whether any differs, so all raise together and no one goes
        # on to broadcasts the others skip (which left the group out of step).
        differs = np.array([int(meta["arrays"] != arrays)], dtype=np.int64)
        await comm.all_reduce(differs, "max")
        if differs[0]:
            raise ConfigError(
                f"State.sync: rank {root} holds arrays {meta['arrays']}; rank {comm.rank} "
                f"holds {arrays} (some member differs): every member must create State "
                "with the same arrays"
            )
        synced: dict[str, Any] = dict(meta["values"])
        for name in arrays:
            buffer = np.array(committed[name], copy=True)
            await comm.broadcast(buffer, root)
            synced[name] = buffer
        object.__setattr__(self, "_committed", synced)
        object.__setattr__(self, "commits", int(meta["commits"]))
        self.restore()

    def __repr__(self) -> str:
        parts = []
        for name in self.names():
            value = self._values[name]
            shown = f"array{value.shape}:{value.dtype}" if isinstance(value, np.ndarray) else value
            parts.append(f"{name}={shown!r}" if not isinstance(value, np.ndarray) else shown)
        return f"State(commits={self.commits}, {', '.join(parts)})"


def _copy(values: dict[str, Any]) -> dict[str, Any]:
    return {
        n: (v.copy() if isinstance(v, np.ndarray) else copy.deepcopy(v)) for n, v in values.items()
    }


async def run(
    fn: Callable[[Communicator, State], Awaitable[T]],
    state: State,
    *,
    registry: str | None = None,
    world_size: int | None = None,
    min_size: int = 1,
    min_size_timeout: float = 60.0,
    max_restarts: int = 1000,
    config: CommConfig | None = None,
    name: str | None = None,
    on_restart: Callable[[Communicator, BaseException], Any] | None = None,
) -> T:
    """Run `await fn(comm, state)` elastically; returns what `fn` returns on this member.

    Args:
        fn: the training function; it continues from `state` (see the module docstring).
        state: this member's `State`; a joiner's is replaced by the group's at the sync.
        registry: the registry address (default: `DSML_REGISTRY`).
        world_size: members needed to form a new group (default: `DSML_WORLD_SIZE`, else
            `min_size`); a running group is joined whatever its size.
        min_size: fewest members to train with; below it, wait for joiners.
        min_size_timeout: seconds to wait below `min_size` before `BelowMinSizeError`.
        max_restarts: give up (re-raise) after this many restarts.
        on_restart: called with (comm, error) before each restart (logging, metrics).
    """
    if type(min_size) is not int or min_size < 1:
        raise ConfigError(f"min_size must be a positive integer, got {min_size!r}")
    size = world_size if world_size is not None else _env_world_size(min_size)

    async def join() -> Communicator:
        comm = await init_or_join(registry, size, config=config, name=name)
        comm.interrupt_on_join = True
        return comm

    comm = await join()
    restarts = 0
    try:
        while True:
            try:
                await _wait_for_size(comm, min_size, min_size_timeout)
                await state.sync(comm)
                return await fn(comm, state)
            except EvictedError as exc:
                log.warning("evicted; joining again as a new member: %s", exc)
                await comm.aclose()
                comm = await join()
                error: BaseException = exc
            except MembershipChangedError as exc:
                error = exc
                await _wait_for_successor(comm, exc, min_size_timeout)
            restarts += 1
            if restarts > max_restarts:
                raise error
            state.restore()
            log.warning("restart %d at commit %d: %s", restarts, state.commits, str(error)[:200])
            if on_restart is not None:
                on_restart(comm, error)
    finally:
        await comm.aclose()


def _env_world_size(default: int) -> int:
    value = env_int(environ(), "DSML_WORLD_SIZE")
    return value if value is not None else default


async def _wait_for_successor(
    comm: Communicator, error: MembershipChangedError, patience: float
) -> None:
    """After a loss or a leave, wait until the view that follows the failed epoch is
    known: ranks (who is rank 0, the root of the sync) are only right in that view."""
    if not isinstance(error, PeerLostError | MemberLeftError | NoQuorumError):
        return  # members joined: the new view is already in place
    failed = error.epoch if error.epoch is not None else comm.epoch
    deadline = time.monotonic() + patience
    while comm.epoch <= failed and not comm.evicted:
        left = deadline - time.monotonic()
        if left <= 0:
            return  # the next call fails again and says why
        try:
            view = await comm.wait_view_change(timeout=left)
        except (TimeoutError, EvictedError):
            return  # the next call fails again and says why
        if view.epoch > failed:
            return
        await asyncio.sleep(0.01)  # a change of an older epoch is still being applied


async def _wait_for_size(comm: Communicator, min_size: int, patience: float) -> None:
    """Until the group has min_size members, by the newest view announced: a view that
    admits joiners is installed by this member's next collective (the sync that follows,
    which the joiners make too), so waiting for `comm.world_size` to grow waited for good
    (and got this member evicted as silent by the joiner it was waiting for)."""
    deadline = time.monotonic() + patience
    size = comm.world_size
    while size < min_size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BelowMinSizeError(
                f"the group has had {size} member(s), fewer than min_size="
                f"{min_size}, for {patience:g} s; start more workers or lower min_size"
            )
        try:
            size = (await comm.wait_view_change(timeout=left)).size
        except TimeoutError:
            continue
        await asyncio.sleep(0)
