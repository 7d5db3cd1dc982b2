"""The communicator's end of the dependency engine (communicator layer).

`comm.engine` and `comm.var` live here, with the two rules that keep collectives in the
same order on every rank when some of them go through the engine:

* A collective pushed into the engine takes its turn (its collective id) in an *issue* op
  that mutates `comm.var`. That op runs even if a var it touches is poisoned: if its input
  is, it fails the collective on every rank instead of skipping it on this one, which
  would leave the ranks' ids out of step.
* A collective called outside the engine while pushed ones are still waiting to be issued
  queues behind them through `comm.var`; from inside a running op it does not (the op's
  place in the graph orders it, and queueing could wait for the op itself).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from ..collectives.interop import like, with_native, writes_in_place
from ..engine import Engine, OpHandle, Tagged, Var, current_op
from ..errors import CollectiveAbortedError, CollectiveTimeoutError, ConfigError, DsmlError
from .collective_handle import CollectiveHandle
from .plans import Request
from .runner import Runner

__all__ = ["EngineLink"]

Array = Any


class EngineLink:
    """A communicator's engine, its ordering var, and pushed or queued collectives."""

    def __init__(
        self,
        runner: Runner,
        start: Callable[[Request], CollectiveHandle[Any]],
        where: Callable[[], tuple[int, int]],
        *,
        trace: bool = False,
    ) -> None:
        self._runner = runner
        self._start = start  # the communicator's: how a pushed collective is started
        self._trace = trace
        self._where = where  # (rank, epoch), for names and errors
        self._engine: Engine | None = None
        self._var: Var | None = None

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = Engine(name=f"rank {self._where()[0]}", trace=self._trace)
        return self._engine

    @property
    def var(self) -> Var:
        if self._var is None:
            self._var = self.engine.new_var("comm")
            self._var.set_watch(_TurnKeeper(self._runner))
        return self._var

    async def aclose(self, *, cancel: bool) -> None:
        if self._engine is not None:
            await self._engine.aclose(cancel=cancel)

    # -- pushed collectives -----------------------------------------------------------------

    def push_collective(
        self,
        tagged: Tagged[Array],
        read: Iterable[Var],
        request: Request,
        pushed: Any,
    ) -> OpHandle[Array]:
        """Push an issue op (mutates tagged.var and comm.var) and a completion op.
        `pushed` is the data request.x was made from (tagged.data when pushed: an op
        running meanwhile may have replaced it since, which the issue op sees)."""
        started: list[Any] = []  # the collective's handle, or why it did not start
        source: list[Any] = []  # the data it was issued for
        cancelled = False
        name = f"{request.collective}({tagged.var.name})"

        async def issue() -> None:
            op = current_op()
            if op is not None and op.blocked is not None:
                self._runner.reject(request, f"its input {tagged.var.name!r}: {op.blocked}")
                started.append(op.blocked)
                return
            source.append(tagged.data)
            try:
                if tagged.data is pushed:
                    started.append(self._start(request))
                else:  # an earlier op of the engine set the data since the push
                    now = tagged.data
                    started.append(
                        with_native(now, True, lambda x: self._start(replace(request, x=x)))
                    )
            except DsmlError as exc:  # the id was taken all the same: comm.var stays clean
                started.append(exc)
                return
            started[0].claim()  # complete() awaits it (or the engine cancels it)
            if cancelled:
                started[0].cancel()

        async def complete() -> Array:
            if not started:  # the issue op was cancelled itself (engine closing)
                raise asyncio.CancelledError(f"{name} was cancelled before it was issued")
            outcome = started[0]
            if isinstance(outcome, BaseException):
                raise outcome
            value = await outcome
            data = source[0]
            if tagged.data is data and not writes_in_place(data):
                # JAX arrays, bytes: the result is a new object, which later readers of
                # the var must see as its data (an in-place call wrote the others)
                tagged.data = like(value, data)
            return value

        answer: list[bool] = []  # what the first cancel() said, said again after

        def cancel() -> bool:
            """Cancel the collective (issued or not yet), not the op: the op still waits
            for it to end, so its var stays held while the collective may use the data."""
            nonlocal cancelled
            if answer:
                return answer[0]
            if not started:
                cancelled = True  # issue() cancels it right after starting it
                answer.append(True)
            elif isinstance(started[0], BaseException):
                answer.append(False)  # it never started: the op fails with that error
            else:
                answer.append(bool(started[0].cancel()))  # False: it had already ended
            return answer[0]

        mutate = [tagged.var, self.var]
        self.engine.push(issue, read=read, mutate=mutate, name=f"issue {name}", always_run=True)
        handle = self.engine.push(complete, mutate=[tagged.var], name=name)
        handle.cancel_through(cancel)
        return handle

    # -- direct calls -----------------------------------------------------------------------

    def must_queue(self) -> bool:
        """Is this direct call made outside the engine while pushed ones wait to issue?"""
        if self._engine is None or self._var is None or not self._engine.is_busy(self._var):
            return False
        op = current_op()
        return op is None or op.done()

    def queue(self, request: Request) -> CollectiveHandle[Any]:
        """Issue a direct call in its turn behind the pushed collectives; its handle now.

        Waiting for the turn counts against the call's timeout. If the call is given up
        (cancelled, timed out) before its turn, it is still issued then, and cancelled at
        once, so that the peers are told as for any cancelled call.
        """
        if self.engine.closed:
            raise ConfigError("the communicator is closing: no new collectives")
        budget = self._runner.budget(request.timeout)
        issued: list[CollectiveHandle[Any] | BaseException] = []
        abandoned = False

        async def issue() -> None:
            try:
                call = self._runner.collective(request)
            except DsmlError as exc:  # the id was taken all the same: comm.var stays clean
                issued.append(exc)
                return
            call.claim()  # wait() awaits it, or cancels it if given up: not the user's
            issued.append(call)
            handle.cid, handle.collective = call.cid, call.collective
            if abandoned:
                call.cancel()

        turn = self.engine.push(
            issue, mutate=[self.var], name="issue a direct call", always_run=True
        )

        async def wait() -> Any:
            nonlocal abandoned
            try:
                async with asyncio.timeout(budget):
                    await asyncio.shield(turn)
            except BaseException as exc:  # given up: cancel what was issued, then re-raise
                abandoned = True
                for call in issued:  # issued already, but given up before this resumed
                    if isinstance(call, CollectiveHandle):
                        call.cancel()
                if isinstance(exc, TimeoutError):
                    raise self._waited_too_long(budget) from None
                current = asyncio.current_task()
                mine = current is not None and current.cancelling() > 0
                if isinstance(exc, asyncio.CancelledError) and self.engine.closed and not mine:
                    raise CollectiveAbortedError(  # the engine closed under it, not a cancel
                        "a call queued behind collectives pushed into comm.engine: the "
                        "communicator was closed before its turn",
                        rank=self._where()[0],
                        epoch=self._where()[1],
                    ) from None
                raise
            outcome = issued[0]
            if isinstance(outcome, BaseException):
                raise outcome
            return await outcome

        handle: CollectiveHandle[Any] = CollectiveHandle(
            asyncio.get_running_loop().create_task(wait()), "queued", 0, self._runner.unclaimed
        )
        return handle

    def _waited_too_long(self, budget: float) -> CollectiveTimeoutError:
        rank, epoch = self._where()
        return CollectiveTimeoutError(
            f"a collective waited {budget:g} s on rank {rank} for collectives pushed into "
            "comm.engine to be issued first; wait for them (await comm.engine.wait_var("
            "comm.var)) or push this one too",
            rank=rank,
            epoch=epoch,
        )


class _TurnKeeper:
    """Watches the ops that mutate `comm.var` (they run one at a time, and collectives
    made outside the engine meanwhile wait for them): an op that did not run (its input
    poisoned), or that failed before it made any collective, takes the turn it would have
    taken (`Runner.skip_turn`), as it may have failed on this rank only. Without it, this
    rank's collective ids fell one behind the others' for good, and later calls of the
    same shape paired with the wrong ones: wrong sums, no error."""

    def __init__(self, runner: Runner) -> None:
        self._runner = runner
        self._at_start: dict[int, int] = {}  # op's seq -> turns taken when it started

    def started(self, op: Any) -> None:
        self._at_start[op.seq] = self._runner.turns

    def ended(self, op: Any, error: BaseException | None, ran: bool) -> None:
        at = self._at_start.pop(op.seq, None)
        if error is None or isinstance(error, asyncio.CancelledError):
            return
        if not ran:
            self._runner.skip_turn(
                f"engine op {op.name!r} (it mutates comm.var) did not run: {error}"
            )
        elif at is not None and self._runner.turns == at:
            self._runner.skip_turn(
                f"engine op {op.name!r} (it mutates comm.var) failed before it made a "
                f"collective: {type(error).__name__}: {error}"
            )
