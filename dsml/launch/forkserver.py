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

What a rank can tell apart from `python SCRIPT`: the ranks share one hash seed,
`sys.orig_argv` shows the server's command, and numpy, pyzmq, msgpack and dsml are the
ones the server imported (a package of the same name next to the script does not replace
them). Children reseed numpy's global random state, as `random` reseeds itself,
re-read dsml's logging settings from their environment, and report an uncaught dsml error
or KeyboardInterrupt in short (`dsml/_report.py`; DSML_TRACEBACK=1 for Python's report).

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
import selectors
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import msgpack

from .._process import die_with_parent

__all__ = ["ForkServer", "RankProcess", "forkable"]

log = logging.getLogger("dsml.launcher")

_PRELOAD = ("numpy", "zmq", "msgpack", "dsml")
_MAX_PACKET = 1 << 20  # a request: argv and environment
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


# -- the launcher's side ----------------------------------------------------------------------


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
            packet = self._sock.recv(_MAX_PACKET)
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


def _same(protocol: asyncio.StreamReaderProtocol) -> asyncio.StreamReaderProtocol:
    """The protocol factory of `connect_read_pipe` (a lambda's type mypy cannot infer)."""
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


class _Server:
    """The server's loop: forks, signals and reaps its children (see the module doc)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.live: set[int] = set()  # children not reaped yet

    def serve(self) -> tuple[dict[str, Any], list[int]] | None:
        """Serve requests until the launcher closes the socket (None), or, in a child just
        forked, return its request and stream fds."""
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda _sig, _frame: None)
        selector = selectors.DefaultSelector()
        selector.register(self.sock, selectors.EVENT_READ)
        selector.register(wake_r, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj is not self.sock:
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake_r, 512)
                    self.reap()
                    continue
                try:
                    packet, fds, flags, _addr = socket.recv_fds(self.sock, _MAX_PACKET, 2)
                except OSError:
                    packet, fds, flags = b"", [], 0
                if not packet:  # the launcher closed its end, or died
                    self.stop_all()
                    self.reap()
                    return None
                request = None if flags & socket.MSG_TRUNC else _unpack(packet)
                if request is not None and "signal" in request:
                    self.signal(int(request["pid"]), int(request["signal"]))
                    continue
                child = self.fork(request, fds)
                if child is not None:  # in the child: leave the server's state behind
                    selector.close()
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    os.close(wake_r)
                    os.close(wake_w)
                    self.sock.close()
                    return child

    def fork(
        self, request: dict[str, Any] | None, fds: list[int]
    ) -> tuple[dict[str, Any], list[int]] | None:
        if request is None or len(fds) != 2:
            error = "a request too large or malformed"
        else:
            server = os.getpid()
            try:
                pid = os.fork()
            except OSError as exc:
                error = f"fork: {exc}"
            else:
                if pid == 0:
                    request["server"] = server
                    return request, fds
                self.live.add(pid)
                _send(self.sock, ["pid", pid])
                error = ""
        for fd in fds:
            os.close(fd)
        if error:
            _send(self.sock, ["error", error])
        return None

    def signal(self, pid: int, sig: int) -> None:
        if pid not in self.live:
            return  # reaped: the pid may be another process's by now
        try:
            os.killpg(pid, sig)  # each rank leads its own session and group
        except ProcessLookupError:  # not in its own session yet
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def stop_all(self) -> None:
        """Kill the process group of every rank still running, with what its rank started
        there (a data loader's workers, a subprocess). A rank dies with the server anyway
        (its parent-death signal); the processes it started would outlive it."""
        for pid in sorted(self.live):
            self.signal(pid, signal.SIGKILL)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.live.discard(pid)
            _send(self.sock, ["exit", pid, os.waitstatus_to_exitcode(status)])


def _unpack(packet: bytes) -> dict[str, Any] | None:
    try:
        request = msgpack.unpackb(packet)
    except (ValueError, msgpack.UnpackException):
        return None
    return request if isinstance(request, dict) else None


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """In a fresh child: take the rank's session, CPUs, streams, environment and argv."""
    os.setsid()
    if die_with_parent is not None:
        die_with_parent()
    if os.getppid() != request["server"]:  # the server died before the line above
        os._exit(1)
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
    from .. import _report
    from .. import log as dsml_log

    dsml_log.configure_from_env()  # what `import dsml` does with the environment, again
    _report.install(trim=_without_server_frames)  # short reports of dsml errors (_report.py)


def _run(argv: list[str]) -> None:
    """Run `python SCRIPT args` or `python -m MODULE args` in this interpreter's
    `__main__`, as Python does (what is left there after the script stays, for atexit
    handlers and pickling)."""
    import builtins
    import importlib.machinery
    import io
    import runpy
    import types

    # A fresh __main__: the server's own (`python -c`) holds what its command imported.
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    safe_path = getattr(sys.flags, "safe_path", False)  # then Python adds no folder
    if argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        if not safe_path:
            sys.path[0] = os.getcwd()
        runpy._run_module_as_main(argv[2], alter_argv=True)  # type: ignore[attr-defined]
        return
    script = argv[1]
    sys.argv = [script, *argv[2:]]
    path = os.path.abspath(script)
    if not safe_path:
        sys.path[0] = os.path.dirname(os.path.realpath(script))
    if not os.path.isfile(path):  # a folder or zip with __main__.py, or nothing
        if not os.path.exists(path):
            print(
                f"{sys.executable}: can't open file {path!r}: [Errno 2] No such file or directory",
                file=sys.stderr,
            )
            raise SystemExit(2)
        runpy.run_path(path, run_name="__main__")
        return
    main.__dict__.update(
        __file__=path,
        __cached__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", path),
    )
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec")
    exec(code, main.__dict__)


def _without_server_frames(tb: TracebackType | None) -> TracebackType | None:
    """A rank's traceback as `python SCRIPT` has it: without the server's frames at its top."""
    import runpy

    ours = (__file__, runpy.__file__, "<frozen runpy>", "<string>")
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    return tb


#: The server's command. `python -c` puts the working directory first on sys.path, where
#: `python SCRIPT` would not: a `dsml` (or numpy, zmq, msgpack) in the launcher's working
#: directory, such as another checkout, would be the one the ranks run. The server puts
#: the folder of the launcher's own dsml there instead (each rank then replaces it with
#: its script's folder, as Python does).
_SERVER_CODE = (
    "import sys\n"
    "if sys.path[:1] == ['']: sys.path[0] = sys.argv[2]\n"
    "from dsml.launch.forkserver import main; main()"
)


def _package_root() -> str:
    """The folder holding the dsml package this launcher runs."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    """The server: `python -c _SERVER_CODE FD ROOT` (see `_SERVER_CODE`)."""
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
    child = _Server(sock).serve()
    if child is None:
        return
    request, fds = child
    _become(request, fds)
    _run(request["argv"])  # SystemExit is Python's; other exceptions go to _report's hook
