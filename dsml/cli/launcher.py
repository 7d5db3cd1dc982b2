"""Starting N rank processes and supervising them (cli layer).

Each rank is a child process in its own session, so a terminal's Ctrl-C reaches the
launcher only and is forwarded exactly once; a second Ctrl-C kills. Ranks are asked to
stop with SIGINT, also when the launcher got SIGTERM: Python turns SIGINT into
KeyboardInterrupt, so `async with dsml.init()` closes and leaves the registry (a SIGTERM
would end a Python rank on the spot and leave the registry believing it still runs).
Every line a child prints is passed on with its rank in front. When a rank fails, the
others are stopped (SIGINT, then SIGKILL after a grace period) and a short root-cause block
names the rank, how it ended and the last lines of its error output. On Linux the
children also get SIGKILL if the launcher itself dies.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from .._process import describe_exit, die_with_parent

__all__ = ["Failure", "Launch", "rank_environment"]

#: on_line(rank, stream name, line) replaces the default printing when given.
LineSink = Callable[[int, str, str], None]

_TAIL_LINES = 20
_CONSEQUENCE_GRACE_S = 2.0  # how long a rank that caused others' failure has to exit


def rank_environment(
    base: Mapping[str, str], rank: int, world_size: int, registry: str, device: str | None = None
) -> dict[str, str]:
    """The environment of one rank: DSML_* for dsml.init, and what torchrun users expect.

    With `device` ("cpu", "cuda" or "cuda:N") every rank gets DSML_DEVICE; with "cuda",
    `dsml.init()` then picks GPU LOCAL_RANK % gpu count, so rank i gets GPU i.
    """
    env = dict(base)
    if device is not None:
        env["DSML_DEVICE"] = device
    env.update(
        DSML_REGISTRY=registry,
        DSML_WORLD_SIZE=str(world_size),
        DSML_RANK=str(rank),
        DSML_LOCAL_RANK=str(rank),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        PYTHONUNBUFFERED="1",
    )
    if not env.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = "1"  # ranks share the cores; a user's own value stays
    return env


#: Errors a rank raises because another rank failed: not the root cause of a crash.
_CONSEQUENCES = ("CollectiveAbortedError", "PeerLostError", "MembershipChangedError")


@dataclass
class Failure:
    rank: int
    code: int
    tail: list[str] = field(default_factory=list)

    @property
    def consequence(self) -> bool:
        """True when this rank only failed because another one did (as its error says)."""
        last = self.tail[-1] if self.tail else ""
        return last.startswith(tuple(f"dsml.errors.{name}" for name in _CONSEQUENCES))

    def report(self) -> str:
        lines = [
            f"dsml run: rank {self.rank} failed ({describe_exit(self.code)}); "
            "the other ranks were stopped."
        ]
        error = _error_of(self.tail)
        if error:  # its traceback was printed above, with the rank's other output
            lines.append(f"---- rank {self.rank}'s error (traceback above) ----")
            lines += [f"  {line}" for line in error]
            lines.append("----")
        elif self.tail:
            lines.append(f"---- last lines rank {self.rank} wrote to stderr ----")
            lines += [f"  {line}" for line in self.tail]
            lines.append("----")
        return "\n".join(lines)


def _error_of(tail: list[str]) -> list[str]:
    """The exception lines that end a Python traceback in `tail` ([] if it holds none)."""
    if not any(line.startswith("Traceback (most recent call last)") for line in tail):
        return []
    last_frame = max(i for i, line in enumerate(tail) if line.startswith((" ", "Traceback")))
    return tail[last_frame + 1 :]


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
    ) -> None:
        self.argv = list(argv)
        self.device = device
        self.world_size = world_size
        self.registry = registry
        self.failures: list[Failure] = []
        self.interrupted = 0
        self._env = dict(os.environ if env is None else env)
        self._on_line = on_line
        self._grace_s = grace_s
        self._stdout = stdout or sys.stdout
        self._stderr = stderr or sys.stderr
        self._procs: list[asyncio.subprocess.Process] = []
        self._signalled: set[int] = set()  # ranks this launcher sent a signal to
        self._output_closed = False
        self._tails = [collections.deque[str](maxlen=_TAIL_LINES) for _ in range(world_size)]

    async def run(self) -> int:
        """Start every rank, wait for all to end; returns the exit code for the launcher."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            for rank in range(self.world_size):
                self._procs.append(await self._spawn(rank))
            await asyncio.gather(*(self._supervise(r, p) for r, p in enumerate(self._procs)))
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            self._kill_all(signal.SIGKILL)
        return self._exit_code()

    async def _spawn(self, rank: int) -> asyncio.subprocess.Process:
        env = rank_environment(self._env, rank, self.world_size, self.registry, self.device)
        return await asyncio.create_subprocess_exec(
            *self.argv,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )

    async def _supervise(self, rank: int, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        assert proc.stderr is not None
        await asyncio.gather(
            self._pump(rank, "stdout", proc.stdout), self._pump(rank, "stderr", proc.stderr)
        )
        code = await proc.wait()
        if code != 0 and not self.interrupted and rank not in self._signalled:
            failure = Failure(rank, code, list(self._tails[rank]))
            self.failures.append(failure)
            if len(self.failures) == 1:
                if failure.consequence:  # the rank that caused it is probably exiting too
                    await self._wait_others(_CONSEQUENCE_GRACE_S)
                await self._stop_others()

    @property
    def failure(self) -> Failure | None:
        """The root cause: the first rank to fail on its own, else the first to fail."""
        causes = [f for f in self.failures if not f.consequence] or self.failures
        return causes[0] if causes else None

    async def _pump(self, rank: int, name: str, stream: asyncio.StreamReader) -> None:
        async for text in _lines(stream):
            if name == "stderr":
                self._tails[rank].append(text)
            if self._on_line is not None:
                self._on_line(rank, name, text)
            elif not self._output_closed:
                out = self._stdout if name == "stdout" else self._stderr
                try:
                    out.write(f"[rank {rank}] {text}\n")
                    out.flush()
                except BrokenPipeError:  # e.g. piped into `head`: keep supervising quietly
                    self._output_closed = True

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
        if self.interrupted > 1:
            self._kill_all(signal.SIGKILL)
            return
        self._kill_all(signal.SIGINT)
        # A rank that ignores SIGINT or hangs while closing must not keep us alive.
        asyncio.get_running_loop().call_later(self._grace_s, self._kill_all, signal.SIGKILL)

    def _kill_all(self, sig: signal.Signals) -> None:
        """Signal every running rank's process group (a wrapper's children too)."""
        for rank, proc in enumerate(self._procs):
            if proc.returncode is None:
                self._signalled.add(rank)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)  # each rank leads its own session and group

    def _exit_code(self) -> int:
        if self.failure is not None:
            code = self.failure.code
            return code if code > 0 else 128 - code
        if self.interrupted:
            return 130
        codes = [p.returncode or 0 for p in self._procs]
        return next((c if c > 0 else 128 - c for c in codes if c), 0)


_MAX_LINE = 64 * 1024  # a longer stretch without a newline is passed on in pieces


async def _lines(stream: asyncio.StreamReader) -> AsyncIterator[str]:
    """The lines a rank writes, without their newline. A carriage return (a progress bar
    redrawing itself) keeps what a terminal would show: the text after the last one.
    Output without newlines is passed on every 64 KiB instead of failing."""
    pending = b""
    while chunk := await stream.read(_MAX_LINE):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if len(pending) > _MAX_LINE:
            lines.append(pending)
            pending = b""
        for line in lines:
            yield _shown(line)
    if pending:
        yield _shown(pending)


def _shown(line: bytes) -> str:
    text = line.decode(errors="replace").rstrip("\r")
    return text.rsplit("\r", 1)[-1]
