"""Starting N rank processes and supervising them (launch layer).

Each rank is a process in its own session, so a terminal's Ctrl-C reaches the launcher
only and is forwarded exactly once; a second Ctrl-C kills. Ranks of a Python script or
module are forked by a fork server (forkserver.py: one interpreter with numpy, pyzmq
and dsml imported, so ranks start sooner and share its address layout), others are the
launcher's children; with `DSML_FORKSERVER=0`, all are. Ranks are asked to
stop with SIGINT, also when the launcher got SIGTERM: Python turns SIGINT into
KeyboardInterrupt, so `async with dsml.init()` closes and leaves the registry (a SIGTERM
would end a Python rank on the spot and leave the registry believing it still runs).
Every line a child prints is passed on with its rank in front. When a rank fails, the
others are stopped (SIGINT, then SIGKILL after a grace period) and a short root-cause
block, printed after every rank's output, names the rank, how it ended and its error (the
end of its traceback, or of dsml's short report of it), else the last lines it wrote. On
Linux the ranks also get SIGKILL if the launcher itself dies (forked ones through their
server, which gets it first).

What a rank gets (its environment and CPUs) is rank_setup.py's; passing its output on,
output.py's; judging a failure (which one is the root cause), failure.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from .failure import Failure
from .forkserver import ForkServer, RankProcess, forkable
from .output import LineSink, RankOutput
from .rank_setup import child_setup, cpu_sets, rank_environment

__all__ = ["Launch"]

log = logging.getLogger("dsml.launcher")

_CONSEQUENCE_GRACE_S = 2.0  # how long a rank that caused others' failure has to exit


def _free_port() -> int:
    """A TCP port free on loopback now (rank 0's torch store binds it soon after)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Launch:
    """One supervised run of `world_size` copies of `argv` (see module docstring)."""

    def __init__(
        self,
        argv: Sequence[str],
        world_size: int,
        registry: str,
        *,
        env: Mapping[str, str] | None = None,
        on_line: LineSink | None = None,
        grace_s: float = 5.0,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        device: str | None = None,
        ranks: Sequence[int] | None = None,
        node: int | None = None,
        on_failure: Callable[[Failure], None] | None = None,
        cpu_bind: str = "auto",
    ) -> None:
        self.argv = list(argv)
        self.device = device
        self.world_size = world_size
        self.registry = registry
        self.ranks = list(range(world_size) if ranks is None else ranks)  # started here
        self.node = node  # with --nnodes: this launcher's node rank
        self.on_failure = on_failure  # told of each failure of a rank started here
        self.failures: list[Failure] = []
        self.cpus = cpu_sets(len(self.ranks), cpu_bind)  # per local rank; None: unbound
        self.interrupted = 0
        self._stopped_by = ""  # the first signal this launcher got (SIGINT, SIGTERM)
        self._env = dict(os.environ if env is None else env)
        if node is None and not (self._env.get("MASTER_ADDR") and self._env.get("MASTER_PORT")):
            # torch.distributed's env:// rendezvous (dist.init_process_group("dsml") under
            # dsml run) needs a store address, as under torchrun; a user's own values win
            # (with --nnodes, every node must be given the same: set them).
            self._env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        self._grace_s = grace_s
        self._output = RankOutput(self.ranks, on_line, stdout, stderr)
        self._procs: list[asyncio.subprocess.Process | RankProcess] = []
        self._forks: ForkServer | None = None  # see forkserver.py
        self._signalled: set[int] = set()  # ranks this launcher sent a signal to
        self._cause_known = asyncio.Event()  # a root cause (not a consequence) is known
        self._remote_stop: asyncio.Task[None] | None = None

    async def run(self) -> int:
        """Start every rank, wait for all to end; returns the exit code for the launcher."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            if forkable(self.argv, self._env):
                # What the server's interpreter decides at its start: as the ranks get it.
                base = {**self._env, "PYTHONUNBUFFERED": "1"}
                base["OMP_NUM_THREADS"] = base.get("OMP_NUM_THREADS") or "1"
                self._forks = await ForkServer.start(base)
            for index in range(len(self.ranks)):
                if self.interrupted:  # Ctrl-C while starting: start no more ranks
                    break
                self._procs.append(await self._spawn(index))
            await asyncio.gather(*(self._supervise(i, p) for i, p in enumerate(self._procs)))
            if self._remote_stop is not None:
                await self._remote_stop
        finally:
            if self._remote_stop is not None:
                self._remote_stop.cancel()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            self._kill_all(signal.SIGKILL)
            if self._forks is not None:
                await self._forks.aclose()
        return self._exit_code()

    async def _spawn(self, index: int) -> asyncio.subprocess.Process | RankProcess:
        env = rank_environment(
            self._env,
            self.ranks[index],
            self.world_size,
            self.registry,
            self.device,
            local_rank=index,
            local_world_size=len(self.ranks),
            node_rank=self.node or 0,
        )
        cpus = None if self.cpus is None else self.cpus[index]
        if self._forks is not None:
            try:
                return await self._forks.spawn(self.argv, env, cpus)
            except OSError as exc:  # e.g. an environment too large for one packet
                log.info("dsml run: rank %d starts on its own: %s", self.ranks[index], exc)
        return await asyncio.create_subprocess_exec(
            *self.argv,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            preexec_fn=child_setup(cpus),
        )

    async def _supervise(self, index: int, proc: asyncio.subprocess.Process | RankProcess) -> None:
        assert proc.stdout is not None
        assert proc.stderr is not None
        await self._output.relay(index, proc.stdout, proc.stderr)
        code = await proc.wait()
        if code != 0 and not self.interrupted and index not in self._signalled:
            await self._rank_failed(index, code)

    async def _rank_failed(self, index: int, code: int) -> None:
        """A rank started here failed (not stopped by this launcher): report it, and on the
        first failure stop the others, once the rank that caused it had a moment to exit
        when this one failed only because of it."""
        host = socket.gethostname() if self.node is not None else ""
        failure = Failure(self.ranks[index], code, self._output.tail(index), self.node, host)
        if self.on_failure is not None:
            self.on_failure(failure)
        self._add_failure(failure)
        if len(self.failures) == 1:
            if failure.consequence:  # the rank that caused it is probably exiting too
                await self._wait_others(_CONSEQUENCE_GRACE_S)
                if self.node is not None:  # ... or it ran on another node
                    await self._wait_cause()
            await self._stop_others()

    def _add_failure(self, failure: Failure) -> None:
        self.failures.append(failure)
        if not failure.consequence:
            self._cause_known.set()

    def add_remote_failure(self, failure: Failure) -> None:
        """Another node's launcher reported a failed rank: stop the ranks started here
        (after a moment for a local root cause, when the report is only a consequence)."""
        first = not self.failures
        self._add_failure(failure)
        running = any(p.returncode is None for p in self._procs)
        if first and running and self._remote_stop is None:
            loop = asyncio.get_running_loop()
            self._remote_stop = loop.create_task(self._stop_after(failure))

    async def _stop_after(self, failure: Failure) -> None:
        if failure.consequence:  # the rank that caused it may be one of ours, exiting now
            await self._wait_cause()
        await self._stop_others()

    async def _wait_cause(self) -> None:
        """Wait a moment for a root cause (a failure that is no consequence) to be known."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_CONSEQUENCE_GRACE_S):
                await self._cause_known.wait()

    @property
    def failure(self) -> Failure | None:
        """The root cause: the first rank to fail on its own, else the first to fail."""
        causes = [f for f in self.failures if not f.consequence] or self.failures
        return causes[0] if causes else None

    async def _wait_others(self, within_s: float) -> bool:
        """Wait until every rank has exited, at most within_s; True if all exited."""
        running = [asyncio.ensure_future(p.wait()) for p in self._procs if p.returncode is None]
        if not running:
            return True
        _, pending = await asyncio.wait(running, timeout=within_s)
        for waiter in pending:
            waiter.cancel()
        return not pending

    async def _stop_others(self) -> None:
        self._kill_all(signal.SIGINT)
        if not await self._wait_others(self._grace_s):
            self._kill_all(signal.SIGKILL)

    def _on_signal(self, sig: signal.Signals) -> None:
        self.interrupted += 1
        self._stopped_by = self._stopped_by or sig.name
        if self.interrupted == 1 and self.on_failure is not None and self.node is not None:
            # Tell the other nodes (through node 0) that this node was interrupted, so they
            # name that, not one of their ranks failing with MemberLeftError because of it.
            here = socket.gethostname()
            self.on_failure(Failure(-1, 128 + sig.value, [], self.node, here, sig.name))
        if self.interrupted > 1:
            self._kill_all(signal.SIGKILL)
            return
        self._kill_all(signal.SIGINT)
        # A rank that ignores SIGINT or hangs while closing must not keep us alive.
        asyncio.get_running_loop().call_later(self._grace_s, self._kill_all, signal.SIGKILL)

    def _kill_all(self, sig: signal.Signals) -> None:
        """Signal every running rank's process group (a wrapper's children too)."""
        for index, proc in enumerate(self._procs):
            if proc.returncode is None:
                self._signalled.add(index)
                if isinstance(proc, RankProcess):  # forked: its server signals it
                    proc.send_signal(sig)
                    continue
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)  # each rank leads its own session and group

    def interrupt_report(self) -> str:
        """One line for the end of an interrupted run: by what, and how the ranks ended
        (each rank's own output already shows where it was)."""
        killed = sum(1 for p in self._procs if p.returncode == -signal.SIGKILL)
        stopped = len(self._procs)
        how = f"{stopped} rank{'s' if stopped != 1 else ''} stopped"
        if killed:
            why = "a second signal" if self.interrupted > 1 else f"--grace {self._grace_s:g} s"
            how += f", {killed} of them killed (SIGKILL after {why})"
        return f"dsml run: interrupted by {self._stopped_by}: {how}"

    def exit_code(self) -> int:
        """The launcher's exit code (again after late reports from other nodes)."""
        return self._exit_code()

    def _exit_code(self) -> int:
        if self.interrupted:  # what happened here comes first: 128 + the signal's number
            return 128 + signal.Signals[self._stopped_by or "SIGINT"].value
        if self.failure is not None:
            code = self.failure.code
            return code if code > 0 else 128 - code
        codes = [p.returncode or 0 for p in self._procs]
        return next((c if c > 0 else 128 - c for c in codes if c), 0)
