"""Vars: the tags that name a piece of data for the dependency engine (engine layer).

A `Var` stands for one piece of data (a weight array, a gradient buffer, "the
communicator's collective order"). The data itself stays in the user's closures; ops only
declare which vars they read and which they mutate, and the engine orders them from that.

The threaded `Engine` keeps its per-var scheduling state on the var itself, so that wiring
an op costs O(vars the op names) and never scans other ops:

* `_writer`: the last pushed op that mutates the var and has not finished yet (or None);
* `_readers`: the unfinished ops pushed after `_writer` that read the var;
* `_poison_src`: the last pushed op that mutates the var, kept only while its failure
  could still matter (None once it succeeded, or after `clear_error`).

`SerialEngine` ignores those fields and keeps its own table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .handle import OpHandle

__all__ = ["Var", "VarWatch"]


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class VarWatch(Protocol):
    """What a var's watcher is told of the ops that mutate it (on the engine's loop)."""

    def started(self, op: Any) -> None: ...

    def ended(self, op: Any, error: BaseException | None, ran: bool) -> None:
        """`op` ended: succeeded (error None), failed or was cancelled; `ran` is False
        for an op that never started (a var it touches was poisoned)."""
        ...


class Var:
    """A tag for one piece of data; create it with `engine.new_var(name)`."""

    __slots__ = ("_owner", "_poison_src", "_readers", "_watch", "_writer", "name")

    def __init__(self, name: str, owner: _Named) -> None:
        self.name = name
        self._owner = owner
        self._writer: OpHandle[Any] | None = None
        self._readers: set[OpHandle[Any]] = set()
        self._poison_src: OpHandle[Any] | None = None
        #: told when an op that mutates this var starts and how it ends (`VarWatch`):
        #: `comm.var` keeps the ranks' collective turns in step with it
        self._watch: VarWatch | None = None

    def set_watch(self, watch: VarWatch) -> None:
        """Tell `watch` of every op that mutates this var, as it starts and ends
        (`comm.var` keeps the ranks' collective turns in step so)."""
        self._watch = watch

    @property
    def engine_name(self) -> str:
        """Name of the engine that created this var."""
        return self._owner.name

    def __repr__(self) -> str:
        parts = [repr(self.name), f"engine={self._owner.name!r}"]
        if self._writer is not None:
            parts.append(f"writer=#{self._writer.seq}")
        if self._readers:
            parts.append(f"readers={len(self._readers)}")
        return f"Var({', '.join(parts)})"
