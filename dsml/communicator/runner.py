"""Starting and running calls: ids, tasks, timeouts, aborts (communicator layer).

A collective takes the next collective id when it is called (program order is collective
order) and runs as a task at once. The runner gives every call its timeout, turns a
peer's abort into this rank's error, aborts the peers when this rank fails or is
cancelled, and asks the peers where they are before reporting a timeout. It also hands
calls made from other threads (the engine's pool) to the communicator's loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ..config import CommConfig
from ..errors import CollectiveError, CollectiveTimeoutError, ConfigError, DsmlError, ProtocolError
from ..wire import Fingerprint
from .call import Call
from .diagnose import timeout_message
from .handle import CollectiveHandle
from .mesh import Mesh
from .plans import Plan
from .views import ViewKeeper

__all__ = ["Runner"]

T = TypeVar("T")


class Runner:
    """Runs the calls of one communicator on its event loop."""

    def __init__(
        self,
        mesh: Mesh,
        keeper: ViewKeeper,
        config: CommConfig,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.closed = False
        self._mesh = mesh
        self._keeper = keeper
        self._config = config
        self._loop = loop
        self._deferred = 0  # calls waiting for a change of view, in program order
        self._waiting: set[asyncio.Task[Any]] = set()
        self._admission = asyncio.Lock()

    def budget(self, timeout: float | None) -> float:
        """A call's timeout in seconds (the configured default when None)."""
        budget = self._config.timeout if timeout is None else timeout
        if not isinstance(budget, int | float) or not math.isfinite(budget) or budget <= 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        return float(budget)

    def on_loop(self, start: Callable[[], T]) -> T:
        """Run start() on the communicator's loop, also when called from another thread.

        From another thread the call waits until the loop has run it; the caller's context
        variables go with it (the engine marks its ops with one).
        """
        if self.closed:
            raise ConfigError("this communicator is closed")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            return start()
        if running is not None:
            raise ConfigError("this communicator belongs to another event loop")
        if not self._loop.is_running():
            raise ConfigError(
                "collectives must be started from async code while the communicator's event "
                "loop runs (or from a thread while it runs)"
            )
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        context = contextvars.copy_context()

        def call() -> None:
            try:
                done.set_result(context.run(start))
            except BaseException as exc:  # handed to the calling thread
                done.set_exception(exc)

        try:
            self._loop.call_soon_threadsafe(call)
        except RuntimeError:  # closed meanwhile
            raise ConfigError("the communicator's event loop is closed") from None
        return done.result()

    # -- collectives ------------------------------------------------------------------------

    def collective(
        self, plan: Callable[[], Plan], loose: Callable[[], Fingerprint], timeout: float | None
    ) -> CollectiveHandle[Any]:
        """Take the next collective id, plan the call and start it; returns its handle.

        Must run on the communicator's loop (see `on_loop`). While the group changes the
        call first waits its turn (`ViewKeeper.admit`), behind the calls made before it.
        """
        if self._deferred or not self._keeper.immediate():
            self._deferred += 1
            name = _name_of(loose)
            task = self._loop.create_task(self._admit_then_run(plan, loose, timeout))
            self._waiting.add(task)
            task.add_done_callback(self._waiting.discard)
            return CollectiveHandle(task, name, 0)
        call = self._start(plan, loose, timeout)
        assert call.task is not None
        return CollectiveHandle(call.task, call.fingerprint.collective, call.cid)

    async def _admit_then_run(
        self, plan: Callable[[], Plan], loose: Callable[[], Fingerprint], budget: float | None
    ) -> Any:
        try:
            async with self._admission:
                await self._keeper.admit()
                call = self._start(plan, loose, budget)
        finally:
            self._deferred -= 1
        assert call.task is not None
        return await call.task

    def _start(
        self, plan: Callable[[], Plan], loose: Callable[[], Fingerprint], timeout: float | None
    ) -> Call:
        cid = self._mesh.next_cid
        self._mesh.next_cid += 1
        try:
            budget = self.budget(timeout)
            planned = plan()
        except ConfigError as exc:
            rejected = Call(self._mesh, cid, loose(), self._config.timeout)
            reason = f"rank {self._mesh.rank} rejected its arguments: {exc}"
            self._mesh.abort(rejected, "invalid", reason)
            self._mesh.forget(cid)
            raise
        call = Call(self._mesh, cid, planned.fingerprint, budget)
        self._mesh.register(call)
        self._mesh.started = (call.epoch, cid, planned.fingerprint.describe())
        task = self._loop.create_task(self._run(call, planned))
        call.task = task
        task.add_done_callback(lambda t: self._finished(call, t))
        return call

    def reject(self, fingerprint: Fingerprint, reason: str) -> None:
        """Take the next collective id without running it, and fail it on every peer.

        For a call this rank cannot make (its input is poisoned): its turn is taken like
        any other, so the ranks' collective ids stay in step, and the peers fail loudly
        rather than pair this id with a later call.
        """
        if self._deferred or not self._keeper.immediate():
            self._deferred += 1
            self._mesh.spawn(self._admit_then_reject(fingerprint, reason))
            return
        self._reject_now(fingerprint, reason)

    async def _admit_then_reject(self, fingerprint: Fingerprint, reason: str) -> None:
        try:
            async with self._admission:
                await self._keeper.admit()
                self._reject_now(fingerprint, reason)
        except DsmlError:
            pass  # the group changed: there is no call left to fail on the peers
        finally:
            self._deferred -= 1

    def _reject_now(self, fingerprint: Fingerprint, reason: str) -> None:
        cid = self._mesh.next_cid
        self._mesh.next_cid += 1
        rejected = Call(self._mesh, cid, fingerprint, self._config.timeout)
        self._mesh.abort(
            rejected, "failed", f"rank {self._mesh.rank} could not take part: {reason}"
        )
        self._mesh.forget(cid)

    async def _run(self, call: Call, plan: Plan) -> Any:
        call.running = True
        try:
            error = call.failure or self._mesh.check_start(call)
            if error is not None:
                call.failure = error  # already known to the peers: no abort from here
                raise error
            async with asyncio.timeout(call.timeout):
                return await plan.body(call)
        except asyncio.CancelledError:
            if call.failure is None:
                raise  # cancelled by the caller; _finished aborts the peers
            _uncancel()
            raise call.failure from None
        except TimeoutError as exc:
            if isinstance(exc, CollectiveError):
                raise
            raise await self._timed_out(call) from None
        except (ProtocolError, CollectiveError) as exc:
            if call.failure is None:
                call.failure = exc
                self._mesh.abort(call, "failed", f"rank {self._mesh.rank} failed: {exc}")
            raise

    async def _timed_out(self, call: Call) -> CollectiveTimeoutError:
        call.running = False  # peers' probes and aborts must not cancel the diagnosis
        progress = await self._mesh.probe(call)
        message, missing = timeout_message(
            call.cid, call.fingerprint, self._mesh.rank, call.timeout, progress
        )
        call.failure = CollectiveTimeoutError(
            message,
            missing=missing,
            rank=self._mesh.rank,
            epoch=call.epoch,
            cid=call.cid,
            collective=call.fingerprint.collective,
        )
        self._mesh.abort(call, "timeout", message, missing)
        return call.failure

    def _finished(self, call: Call, task: asyncio.Task[Any]) -> None:
        self._mesh.finish(call)
        self._mesh.finished = (call.epoch, call.cid, call.fingerprint.describe())
        rank = self._mesh.rank
        if task.cancelled() and call.failure is None:
            self._mesh.abort(call, "cancelled", f"rank {rank} cancelled the call")
        elif not task.cancelled() and call.failure is None and task.exception() is not None:
            self._mesh.abort(call, "failed", f"rank {rank} failed: {task.exception()!r}")

    # -- point to point ---------------------------------------------------------------------

    def p2p(
        self,
        make: Callable[[], Awaitable[T]],
        budget: float,
        what: str,
        hint: str,
        peer: int,
        receive: Call | None = None,
    ) -> asyncio.Task[T]:
        """Start a send or a receive (a `receive` Call lets a peer's goodbye fail it)."""
        task = self._loop.create_task(self._run_p2p(make, budget, what, hint, peer, receive))
        if receive is not None:
            receive.task = task
            self._mesh.receives.add(receive)
            task.add_done_callback(lambda _t: self._mesh.receives.discard(receive))
        return task

    async def _run_p2p(
        self,
        make: Callable[[], Awaitable[T]],
        budget: float,
        what: str,
        hint: str,
        peer: int,
        call: Call | None,
    ) -> T:
        try:
            if call is not None:
                call.running = True
                if call.failure is not None:
                    raise call.failure
            async with asyncio.timeout(budget):
                return await make()
        except asyncio.CancelledError:
            if call is None or call.failure is None:
                raise
            _uncancel()
            raise call.failure from None
        except TimeoutError as exc:
            if isinstance(exc, DsmlError):
                raise
            raise CollectiveTimeoutError(
                f"{what} timed out after {budget:g} s on rank {self._mesh.rank}: {hint}",
                missing=[peer],
                rank=self._mesh.rank,
                epoch=self._mesh.epoch,
            ) from None

    # -- closing ----------------------------------------------------------------------------

    async def cancel_all(self) -> None:
        """Refuse new calls, cancel every call in flight (peers are told), wait briefly."""
        self.closed = True
        tasks = [c.task for c in self._mesh.calls.values() if c.task is not None]
        tasks += [r.task for r in self._mesh.receives if r.task is not None]
        tasks += list(self._waiting)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)


def _name_of(loose: Callable[[], Fingerprint]) -> str:
    try:
        return loose().collective
    except Exception:  # the call itself reports bad input when it is admitted
        return "collective"


def _uncancel() -> None:
    """Our own cancellation became the call's error: it is not the caller's cancel."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
