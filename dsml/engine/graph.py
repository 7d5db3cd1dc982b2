"""The dependency graph of the threaded engine: wiring, releasing, poison (engine layer).

Pure data-structure code, no event loop: the `Engine` calls these functions on its loop
thread, so nothing here needs a lock.

How an op is wired when it is pushed (`link`), per var it names:

    reads v:    wait for v's unfinished last writer;        join v's readers
    mutates v:  wait for v's unfinished last writer and     become v's last writer,
                for every unfinished reader since;          readers start empty

Each edge is one entry in the earlier op's `_dependents` and one count in the later op's
`_npending`; an op is ready when the count reaches zero. Finished ops are removed from
the vars at once (`release`), so a var only ever points at unfinished ops and wiring costs
O(vars named + readers waited for), never a scan over all ops.

Poison travels along a separate, sparser set of edges: at push time an op records, per
var, the last op that mutated it (`var._poison_src`, None after `clear_error`). Because
the op waits for that writer anyway, the writer has finished by the time the op is
ready, and `first_poison` can look at its outcome. A writer that failed (or was
cancelled while running) poisons every var it mutates; an op that meets a poisoned var
does not run, fails with DependencyFailedError, and passes the same `Poison` (the original
error) on to the vars it mutates. A cancelled, never-started op passes on, per var, the
poison it would have met (`inherit`), so removing it changes nothing for the others.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from .handle import OpHandle, Poison
from .var import Var

__all__ = ["first_poison", "inherit", "link", "release"]

Op = OpHandle[Any]


def link(op: Op) -> None:
    """Wire a new op behind the unfinished ops it must wait for (see module docstring)."""
    for var in op._reads:
        writer = var._writer
        if writer is not None:
            writer._dependents.append(op)
            op._npending += 1
        if var._poison_src is not None:
            op._preds.append((var, var._poison_src))
        var._readers.add(op)
    for var in op._mutates:
        writer = var._writer
        if writer is not None:
            writer._dependents.append(op)
            op._npending += 1
        readers = var._readers
        if readers:
            for reader in readers:
                reader._dependents.append(op)
            op._npending += len(readers)
            var._readers = set()
        if var._poison_src is not None:
            op._preds.append((var, var._poison_src))
        var._writer = op
        var._poison_src = op


def release(op: Op, ready: deque[Op]) -> None:
    """Take a finished op out of the graph; append the ops it was the last wait of."""
    op._node_done = True
    for var in op._reads:
        var._readers.discard(op)
    for var in op._mutates:
        if var._writer is op:
            var._writer = None
        if var._poison_src is op and op._poison_for(var) is None:
            var._poison_src = None
    dependents = op._dependents
    op._dependents = []
    for dependent in dependents:
        dependent._npending -= 1
        if dependent._npending == 0:
            ready.append(dependent)
    waiters = op._node_waiters
    if waiters is not None:
        op._node_waiters = None
        for countdown in waiters:
            countdown.tick()


def first_poison(op: Op) -> tuple[Var, Poison] | None:
    """Return the first poisoned var a ready op meets (and why), or None; forget preds."""
    preds = op._preds
    if not preds:
        return None
    op._preds = []
    for var, pred in preds:
        assert pred._node_done, "a poison predecessor is always waited for"
        poison = pred._poison_for(var)
        if poison is not None:
            return var, poison
    return None


def passed_on(op: Op) -> dict[Var, Poison]:
    """The poison a ready op meets, per var it mutates: what it passes on if it is
    cancelled before it runs."""
    inherited: dict[Var, Poison] = {}
    for var, pred in op._preds:
        if var in op._mutates:
            poison = pred._poison_for(var)
            if poison is not None:
                inherited[var] = poison
    return inherited


def inherit(op: Op) -> None:
    """Let a cancelled, never-run op pass on the poison it would have met, per var."""
    op._inherited = passed_on(op)
    op._preds = []
