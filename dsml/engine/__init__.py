"""Dependency engine: schedule ops from the vars they read and mutate (engine layer).

The lecture's interface, asynchronous. Data is tagged with vars; an op is pushed with the
vars it reads and those it mutates, and the engine runs it as soon as that is safe:

    engine = Engine()
    a, b = engine.new_var("a"), engine.new_var("b")
    op = engine.push(fn, read=[a], mutate=[b])   # an awaitable handle, at once
    await engine.wait_var(b); await engine.wait_all()

Modules, by role:

* `var` — `Var`, the tag (and the threaded engine's per-var scheduling state);
* `tagged` — `Tagged`, the lecture's `A.data` / `A.var` pair;
* `context` — `current_op()`, the op running in this context;
* `handle` — `OpHandle`, the op record and its awaitable face;
* `graph` — wiring ops into the dependency graph, releasing them, poison rules;
* `engine` — `Engine`: runs ops on the loop or the thread pool, waits, cancels, closes;
* `inbox` — pool threads handing results back to the loop;
* `serial` — `SerialEngine`, the one-at-a-time reference used as the tests' oracle;
* `base`, `spec` — what both engines share (counters, argument checks, error text);
* `trace` — Chrome / Perfetto trace files of what ran where.

The engine knows nothing about networks; the communicator pushes collectives into it.
"""

from __future__ import annotations

from .context import current_op
from .engine import Engine
from .handle import OpHandle
from .serial import SerialEngine
from .tagged import Tagged
from .var import Var

__all__ = ["Engine", "OpHandle", "SerialEngine", "Tagged", "Var", "current_op"]
