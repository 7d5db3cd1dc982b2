"""Starting ranks by forking one prepared interpreter (cli layer).

`dsml run` starts the ranks of a Python script (or `-m` module) from a *fork server*: one
interpreter that imports numpy, pyzmq, msgpack and dsml once, then forks a child per
rank, which runs the script as `python SCRIPT` would (`__main__`, `sys.argv`, `sys.path`,
its own environment, session and CPUs). Two reasons:

- Ranks that share a CPU run faster. Forked ranks have the same address layout (the job
  still gets a random one), so the CPU's branch predictors, which are indexed by address,
  stay trained when the kernel switches from one rank to another. With separately
  started interpreters every rank has its own layout and each switch leaves the next rank
  to retrain them: a 4 KiB all_reduce at 4 ranks on 2 CPUs took about 1.6x longer
  (measured: 290-440 us against 180-190 us per call, `docs/operations.md`).
- The imports happen once instead of once per rank.

The fork server is single-threaded when it forks (it refuses to serve otherwise: numpy's
BLAS starts threads when OMP_NUM_THREADS asks for more than one, and then `dsml run`
starts interpreters as before). Children reseed numpy's global random state, as
`random` reseeds itself, so ranks do not draw the same numbers. `DSML_FORKSERVER=0`
turns it off.

Protocol, on a SOCK_SEQPACKET socket pair (one message per packet, msgpack):
launcher -> server: `{argv, env, cwd, cpus}` with the child's stdout and stderr as
SCM_RIGHTS; server -> launcher: `["ready", ok, reason]` once, `["pid", pid]` per fork,
`["exit", pid, returncode]` as children end (negative: killed by that signal).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import selectors
import signal
import socket
import sys
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

from .._process import die_with_parent

__all__ = ["ForkServer", "RankProcess", "forkable"]

_PRELOAD = ("numpy", "zmq", "msgpack", "dsml")
_MAX_PACKET = 1 << 20  # a request: argv and environment
_READY_S = 60.0  # the server's imports take well under a second; a stuck one is not used


def forkable(argv: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether `argv` is `python SCRIPT ...` or `python -m MODULE ...` of this interpreter
    (what the fork server can run) and the environment allows it."""
    if env.get("DSML_FORKSERVER", "1") == "0" or sys.platform != "linux":
        return False
    if len(argv) < 2 or argv[0] != sys.executable:
        return False
    return (argv[1] == "-m" and len(argv) > 2) or not argv[1].startswith("-")


# -- the launcher's side ----------------------------------------------------------------------


class RankProcess:
    """A rank forked by the server: what the launcher uses of `asyncio.subprocess.Process`."""

    def __init__(self, pid: int, stdout: asyncio.StreamReader, stderr: asyncio.StreamReader):
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._ended: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def _end(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._ended.set_result(code)

    async def wait(self) -> int:
        return await asyncio.shield(self._ended)


class ForkServer:
    """The launcher's handle on a fork server process (see the module docstring)."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._replies: asyncio.Queue[list[Any]] = asyncio.Queue()
        self._ranks: dict[int, RankProcess] = {}
        self._exited: dict[int, int] = {}  # exits reported before their pid was known
        self.reason = ""  # why it is not serving

    @classmethod
    async def start(cls, env: Mapping[str, str]) -> ForkServer | None:
        """A ready fork server started with `env`, or None (then start ranks directly)."""
        server = cls()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            server._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                "from dsml.cli.forkserver import main; main()",
                str(theirs.fileno()),
                env=dict(env),
                stdin=asyncio.subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        except OSError as exc:
            ours.close()
            server.reason = str(exc)
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
            server.reason = str(rest[1]) if kind == "ready" else f"it did not start ({kind})"
            await server.aclose()
            return None
        return server

    async def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], cpus: set[int] | None
    ) -> RankProcess:
        """Fork a rank running argv (python SCRIPT or -m MODULE) with this environment."""
        assert self._sock is not None
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
            raise OSError(f"the fork server could not start a rank ({kind})")
        proc = RankProcess(int(rest[0]), readers[0], readers[1])
        self._ranks[proc.pid] = proc
        if proc.pid in self._exited:
            proc._end(self._exited.pop(proc.pid))
        return proc

    async def _reply(self) -> list[Any]:
        return await self._replies.get()

    def _readable(self) -> None:
        assert self._sock is not None
        try:
            packet = self._sock.recv(_MAX_PACKET)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            packet = b""
        if not packet:  # the server ended: its children got SIGKILL with it
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            for proc in self._ranks.values():
                proc._end(-signal.SIGKILL)
            self._replies.put_nowait(["ended"])
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


def _same(protocol: asyncio.StreamReaderProtocol) -> asyncio.StreamReaderProtocol:
    return protocol


# -- the server's side -----------------------------------------------------------------------


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _send(sock: socket.socket, message: list[Any]) -> None:
    with contextlib.suppress(OSError):  # the launcher is gone: we end with it
        sock.send(msgpack.packb(message))


def _serve(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """Fork a child per request and report how children end. Returns (request, its fds)
    in a child; None in the server once the launcher has closed the socket."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda _sig, _frame: None)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj is not sock:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 512)
                _reap(sock)
                continue
            try:
                packet, fds, _flags, _addr = socket.recv_fds(sock, _MAX_PACKET, 2)
            except OSError:
                packet, fds = b"", []
            if not packet:
                _reap(sock)
                return None
            pid = os.fork()
            if pid == 0:  # the rank: leave the server's state behind
                selector.close()
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_r)
                os.close(wake_w)
                sock.close()
                return msgpack.unpackb(packet), fds
            for fd in fds:
                os.close(fd)
            _send(sock, ["pid", pid])


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, ["exit", pid, os.waitstatus_to_exitcode(status)])


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """In a fresh child: take the rank's session, CPUs, streams, environment and argv."""
    os.setsid()
    if die_with_parent is not None:
        die_with_parent()
    if request["cpus"] is not None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, request["cpus"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, target in zip(fds, (1, 2), strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if "numpy.random" in sys.modules:  # as `random` does after a fork
        sys.modules["numpy.random"].seed()
    from .. import log

    log.configure_from_env()  # what `import dsml` does with the environment, again


def _run(argv: list[str]) -> None:
    """Run `python SCRIPT args` or `python -m MODULE args` in this interpreter."""
    import runpy

    if argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        script = argv[1]
        sys.argv = [script, *argv[2:]]
        sys.path[0] = os.path.dirname(os.path.realpath(script))
        runpy.run_path(os.path.abspath(script), run_name="__main__")  # as __file__ is


def _print_error(exc: BaseException) -> None:
    """The traceback `python SCRIPT` prints: without this module's and runpy's frames."""
    import runpy

    ours = (__file__, runpy.__file__, "<frozen runpy>")
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)
    sys.stderr.flush()


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    reason = ""
    try:
        for name in _PRELOAD:
            __import__(name)
    except ImportError as exc:
        reason = f"cannot import {exc.name}"
    if not reason and _threads() > 1:
        reason = f"{_threads()} threads after its imports (OMP_NUM_THREADS > 1?)"
    _send(sock, ["ready", not reason, reason])
    if reason:
        return
    child = _serve(sock)
    if child is None:
        return
    request, fds = child
    _become(request, fds)
    try:
        _run(request["argv"])
    except SystemExit:
        raise
    except KeyboardInterrupt as exc:  # as Python does: report, then end by SIGINT
        _print_error(exc)
        sys.stdout.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException as exc:
        _print_error(exc)
        raise SystemExit(1) from None
