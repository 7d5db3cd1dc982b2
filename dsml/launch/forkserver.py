"""Starting ranks by forking one prepared interpreter (launch layer).

`dsml run` starts the ranks of a Python script (or `-m` module) from a *fork server*: one
interpreter that imports numpy, pyzmq, msgpack and dsml once, then forks a child per
rank, which runs the script in its `__main__` as `python SCRIPT` would (`sys.argv`,
`sys.path`, its own environment, working directory, session and CPUs). Two reasons:

- Ranks that share a CPU run faster. Forked ranks have the same address layout (the job
  still gets a random one), so the CPU's branch predictors, which are indexed by address,
  stay trained when the kernel switches from one rank to another. With separately
  started interpreters every rank has its own layout and each switch leaves the next rank
  to retrain them: a 4 KiB all_reduce at 4 ranks on 2 CPUs took about 1.6x longer
  (277-288 us against 172-177 us per call, `docs/operations.md`).
- The imports happen once instead of once per rank.

How the server runs a rank, and what a rank can tell apart from `python SCRIPT`, is
forkserver_loop.py's part (the server's own process).

The server is single-threaded when it forks; it refuses to serve otherwise (numpy's BLAS
starts threads when OMP_NUM_THREADS asks for more than one), and then `dsml run` starts
separate interpreters as before; so it does when `DSML_FORKSERVER=0`, and for a rank
whose request the server cannot take (an environment larger than one packet).

Protocol, on a SOCK_SEQPACKET socket pair, one msgpack message per packet:
launcher -> server: `{argv, env, cwd, cpus}` with the child's stdout and stderr as
SCM_RIGHTS, or `{signal, pid}` (signal a child not yet reaped: the launcher is not the
parent, so only the server knows that a pid is still its child's);
server -> launcher: `["ready", ok, reason]` once, then `["pid", pid]` or `["error",
reason]` per request to fork, and `["exit", pid, returncode]` as children end (negative:
the signal that killed it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

__all__ = ["ForkServer", "RankProcess", "forkable"]

log = logging.getLogger("dsml.launcher")

MAX_PACKET_BYTES = 1 << 20  # a request: argv and environment
_OFF = ("0", "false", "no", "off")  # DSML_FORKSERVER values that turn it off, as DSML_SHM
_READY_S = 60.0  # the server's imports take well under a second; a stuck one is not used


def forkable(argv: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether `argv` is `python SCRIPT ...` or `python -m MODULE ...` of this interpreter
    (what the fork server can run) and the environment allows it."""
    if env.get("DSML_FORKSERVER", "1").strip().lower() in _OFF or sys.platform != "linux":
        return False
    if len(argv) < 2 or argv[0] != sys.executable:
        return False
    return (argv[1] == "-m" and len(argv) > 2) or not argv[1].startswith("-")


class RankProcess:
    """A rank forked by the server: what the launcher uses of `asyncio.subprocess.Process`."""

    def __init__(
        self,
        server: ForkServer,
        pid: int,
        stdout: asyncio.StreamReader,
        stderr: asyncio.StreamReader,
    ) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._server = server
        self._ended: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def send_signal(self, sig: int) -> None:
        """Signal the rank's process group, unless it has ended (through the server, which
        knows: the pid of an ended rank may already be another process's)."""
        if self.returncode is None:
            self._server.signal(self.pid, sig)

    def _end(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._ended.set_result(code)

    async def wait(self) -> int:
        return await asyncio.shield(self._ended)

    def __repr__(self) -> str:
        return f"<RankProcess pid={self.pid} returncode={self.returncode}>"


class ForkServer:
    """The launcher's handle on a fork server process (see the module docstring)."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._replies: asyncio.Queue[list[Any]] = asyncio.Queue()
        self._ranks: dict[int, RankProcess] = {}
        self._exited: dict[int, int] = {}  # exits reported before their pid was known
        self.reason = ""  # why it does not (or no longer does) start ranks

    @classmethod
    async def start(cls, env: Mapping[str, str]) -> ForkServer | None:
        """A ready fork server started with `env`, or None (then start ranks directly)."""
        server = cls()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            server._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                _SERVER_CODE,
                str(theirs.fileno()),
                _package_root(),
                env=dict(env),
                stdin=asyncio.subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                # No parent-death signal for the server: when the launcher dies, the server
                # reads the end of its socket and kills its ranks' process groups first.
                start_new_session=True,
            )
        except OSError as exc:
            ours.close()
            log.info("dsml run: no fork server (%s): ranks start one by one", exc)
            return None
        finally:
            theirs.close()
        ours.setblocking(False)
        server._sock = ours
        asyncio.get_running_loop().add_reader(ours.fileno(), server._readable)
        try:
            kind, *rest = await asyncio.wait_for(server._reply(), _READY_S)
        except TimeoutError:
            kind, rest = "late", []
        if kind != "ready" or not rest[0]:
            reason = str(rest[1]) if kind == "ready" else f"it did not start ({kind})"
            log.info("dsml run: no fork server (%s): ranks start one by one", reason)
            await server.aclose()
            return None
        return server

    async def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], cpus: set[int] | None
    ) -> RankProcess:
        """Fork a rank running argv (python SCRIPT or -m MODULE) with this environment;
        OSError when the server cannot (the caller then starts it another way)."""
        if self._sock is None or self.reason:
            raise OSError(self.reason or "the fork server is closed")
        readers, ends = await _output_pipes()
        request = {
            "argv": list(argv),
            "env": dict(env),
            "cwd": os.getcwd(),
            "cpus": None if cpus is None else sorted(cpus),
        }
        try:
            socket.send_fds(self._sock, [msgpack.packb(request)], ends)
        finally:
            for end in ends:
                os.close(end)  # the child holds them now: EOF comes when it ends
        kind, *rest = await self._reply()
        if kind != "pid":
            raise OSError(f"the fork server could not start a rank: {rest[0] if rest else kind}")
        proc = RankProcess(self, int(rest[0]), readers[0], readers[1])
        self._ranks[proc.pid] = proc
        if proc.pid in self._exited:
            proc._end(self._exited.pop(proc.pid))
        return proc

    def signal(self, pid: int, sig: int) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):  # the server is gone, and its ranks with it
                self._sock.send(msgpack.packb({"signal": int(sig), "pid": pid}))

    async def _reply(self) -> list[Any]:
        return await self._replies.get()

    def _readable(self) -> None:
        assert self._sock is not None
        try:
            packet = self._sock.recv(MAX_PACKET_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            packet = b""
        if not packet:
            self._ended()
            return
        message = msgpack.unpackb(packet)
        if message[0] == "exit":
            pid, code = int(message[1]), int(message[2])
            if pid in self._ranks:
                self._ranks[pid]._end(code)
            else:
                self._exited[pid] = code
        else:
            self._replies.put_nowait(message)

    def _ended(self) -> None:
        """The server ended (or closed its end): its children got SIGKILL with it."""
        assert self._sock is not None
        asyncio.get_running_loop().remove_reader(self._sock.fileno())
        running = [proc for proc in self._ranks.values() if proc.returncode is None]
        if running:
            print(
                f"dsml run: the fork server that started the ranks ended; "
                f"{len(running)} rank(s) were killed with it",
                file=sys.stderr,
                flush=True,
            )
        for proc in running:
            proc._end(-signal.SIGKILL)
        self.reason = "the fork server ended"
        self._replies.put_nowait(["ended"])

    async def aclose(self) -> None:
        """Stop the server (its children have ended, or are killed with it)."""
        if self._sock is not None:
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                await asyncio.wait_for(self._proc.wait(), 5.0)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self._proc.kill()
                await self._proc.wait()

    def __repr__(self) -> str:
        pid = None if self._proc is None else self._proc.pid
        state = f" not serving: {self.reason}" if self.reason else ""
        return f"<ForkServer pid={pid} ranks={len(self._ranks)}{state}>"


async def _output_pipes() -> tuple[list[asyncio.StreamReader], list[int]]:
    """A rank's stdout and stderr: the readers the launcher reads, and the write ends to
    hand to the server (the caller closes them once sent)."""
    loop = asyncio.get_running_loop()
    readers: list[asyncio.StreamReader] = []
    ends: list[int] = []
    for _ in range(2):
        read_end, write_end = os.pipe()
        reader = asyncio.StreamReader(limit=1 << 20)
        protocol = asyncio.StreamReaderProtocol(reader)
        await loop.connect_read_pipe(
            functools.partial(_same, protocol), os.fdopen(read_end, "rb", 0)
        )
        readers.append(reader)
        ends.append(write_end)
    return readers, ends


def _same(protocol: asyncio.StreamReaderProtocol) -> asyncio.StreamReaderProtocol:
    """The protocol factory of `connect_read_pipe` (a lambda's type mypy cannot infer)."""
    return protocol


#: The server's command. `python -c` puts the working directory first on sys.path, where
#: `python SCRIPT` would not: a `dsml` (or numpy, zmq, msgpack) in the launcher's working
#: directory, such as another checkout, would be the one the ranks run. The server puts
#: the folder of the launcher's own dsml there instead (each rank then replaces it with
#: its script's folder, as Python does).
_SERVER_CODE = (
    "import sys\n"
    "if sys.path[:1] == ['']: sys.path[0] = sys.argv[2]\n"
    "from dsml.launch.forkserver_loop import main; main()"
)


def _package_root() -> str:
    """The folder holding the dsml package this launcher runs."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
