"""The fork server's own process: its loop, and how a forked child becomes a rank (launch layer).

`ForkServer.start` (forkserver.py, which also describes the protocol) runs this module's
`main` as `python -c _SERVER_CODE FD ROOT`: it imports numpy, pyzmq, msgpack and dsml,
says whether it can serve, then forks one child per request, signals and reaps them.

What a rank can tell apart from `python SCRIPT`: the ranks share one hash seed,
`sys.orig_argv` shows the server's command, and numpy, pyzmq, msgpack and dsml are the
ones the server imported (a package of the same name next to the script does not replace
them). Children reseed numpy's global random state, as `random` reseeds itself,
re-read dsml's logging settings from their environment, and report an uncaught dsml error
or KeyboardInterrupt in short (`dsml/_report.py`; DSML_TRACEBACK=1 for Python's report).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import sys
from types import TracebackType
from typing import Any

import msgpack

from .._process import die_with_parent
from .forkserver import MAX_PACKET_BYTES

__all__ = ["main"]

_PRELOAD = ("numpy", "zmq", "msgpack", "dsml")


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _send(sock: socket.socket, message: list[Any]) -> None:
    with contextlib.suppress(OSError):  # the launcher is gone: we end with it
        sock.send(msgpack.packb(message))


class _Server:
    """The server's loop: forks, signals and reaps its children (see forkserver.py)."""

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
                    packet, fds, flags, _addr = socket.recv_fds(self.sock, MAX_PACKET_BYTES, 2)
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


def main() -> None:
    """The server: `python -c _SERVER_CODE FD ROOT` (see forkserver.py's `_SERVER_CODE`)."""
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
