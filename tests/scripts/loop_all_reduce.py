"""A worker that loops over all_reduces and prints one JSON line per event (fault tests).

    python tests/scripts/loop_all_reduce.py --registry tcp://127.0.0.1:PORT --world-size 4

Every call reduces an array whose elements are all `value(member id)`, a small integer
fixed per member, so the exact result is the sum of `value(m)` over the members of the
view the call ran in (`comm.view` after the call), whatever the ranks were renumbered to.
A message of an evicted member mixed in, or a segment missing, shows as a wrong sum.

The last element is a stop vote: a worker votes to stop once `--stop-file` exists or
`--max-seconds` passed since it joined; every member of the call sees the same sum, so
all stop after the same call and leave cleanly.

Events (one JSON object per line, flushed; `t` is `time.time()`):
  joined   {pid, member, rank, size, epoch}
  ok       {i, rank, size, epoch, exact, got, expected, dt}   (i counts calls started)
  between  {i}                       before sleeping `--pause` seconds
  lost     {i, error, epoch}         PeerLostError
  changed  {i, error, type}          another MembershipChangedError (not evicted)
  evicted  {i, error}                EvictedError; the worker then exits with code 3
  error    {i, type, error}          anything else; exit code 1
  self_stop {i, step, phase}         printed just before the worker SIGSTOPs itself
  done     {i, stats, epoch, size}   after the last call, before closing
  disconnect {count}                 the peers' connection drops counted so far grew
                                     (polled every 5 ms, also while a call is running)

`--stop-at ITER:STEP` makes this worker SIGSTOP itself in call #ITER (counting from 1)
right after it received its first message of ring step STEP (steps 0..P-2 are the
reduce-scatter, P-1..2P-3 the all-gather, P the world size), or, with STEP `between`,
right after printing `between` following call #ITER. The test then kills (or resumes) it
from outside: that pins the phase of the fault exactly, which timing alone cannot do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time

import numpy as np

import dsml
from dsml.communicator.call import Call

_print_lock = threading.Lock()


def emit(event: str, **fields: object) -> None:
    line = json.dumps({"event": event, "t": time.time(), **fields})
    with _print_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def value_of(member_id: str) -> int:
    return int(member_id[:6], 16) % 97 + 1


class StopPoint:
    """Where this worker SIGSTOPs itself (see the module docstring)."""

    def __init__(self, spec: str | None) -> None:
        self.iteration = 0
        self.step: int | None = None
        self.between = False
        self.current = 0  # the call in progress
        if spec:
            it, step = spec.split(":")
            self.iteration = int(it)
            if step == "between":
                self.between = True
            else:
                self.step = int(step)

    def stop(self, step: int | str, phase: str) -> None:
        self.iteration = 0  # only once
        emit("self_stop", i=self.current, step=step, phase=phase, pid=os.getpid())
        os.kill(os.getpid(), signal.SIGSTOP)


def install_hook(point: StopPoint) -> None:
    """Wrap Call.recv (in this process only) to stop after a given ring step arrived."""
    original = Call.recv

    async def recv(self: Call, peer: int, step: int, chunk: int = 0, **kw: object):  # type: ignore[no-untyped-def]
        received = await original(self, peer, step, chunk, **kw)  # type: ignore[arg-type]
        if (
            point.step is not None
            and point.current == point.iteration
            and step == point.step
            and chunk == 0
        ):
            phase = "reduce_scatter" if step < self.size - 1 else "all_gather"
            point.stop(step, phase)
        return received

    Call.recv = recv  # type: ignore[method-assign]


async def main(args: argparse.Namespace) -> int:
    if args.log:
        logging.basicConfig(
            level=args.log.upper(),
            format="%(asctime)s.%(msecs)03d %(name)s %(levelname)s %(message)s",
            datefmt="%H:%M:%S",
        )
    point = StopPoint(args.stop_at)
    if point.step is not None:
        install_hook(point)
    config = dsml.CommConfig(
        chunk_bytes=args.chunk_bytes, timeout=args.timeout, view_timeout=args.view_timeout
    )
    n = max(2, int(args.mib * (1 << 20)) // 4)
    async with dsml.init(args.registry, world_size=args.world_size, config=config) as comm:
        mine = value_of(comm.member_id)
        emit(
            "joined",
            pid=os.getpid(),
            member=comm.member_id,
            rank=comm.rank,
            size=comm.world_size,
            epoch=comm.epoch,
            value=mine,
        )
        watcher = asyncio.get_running_loop().create_task(watch(comm))
        try:
            return await loop(args, comm, point, mine, n)
        finally:
            watcher.cancel()


async def loop(
    args: argparse.Namespace, comm: dsml.Communicator, point: StopPoint, mine: int, n: int
) -> int:
    """The calls, until the group votes to stop; returns the exit code."""
    joined = time.monotonic()
    x = np.empty(n, dtype=np.float32)
    i = 0
    while True:
        i += 1
        point.current = i
        stop = os.path.exists(args.stop_file) if args.stop_file else False  # noqa: ASYNC240 (a stat per call)
        stop = stop or time.monotonic() - joined > args.max_seconds
        x.fill(mine)
        x[-1] = 1.0 if stop else 0.0
        start = time.perf_counter()
        try:
            await comm.all_reduce(x, algorithm=args.algorithm)
        except dsml.EvictedError as exc:
            emit("evicted", i=i, error=str(exc), stats=comm.statistics())
            return 3
        except dsml.PeerLostError as exc:
            emit("lost", i=i, error=str(exc), epoch=comm.epoch, lost=list(exc.lost))
            continue
        except dsml.MembershipChangedError as exc:
            emit("changed", i=i, type=type(exc).__name__, error=str(exc))
            continue
        except Exception as exc:
            emit("error", i=i, type=type(exc).__name__, error=str(exc))
            return 1
        dt = time.perf_counter() - start
        expected = float(sum(value_of(m.id) for m in comm.view.members))
        body = x[:-1]
        emit(
            "ok",
            i=i,
            rank=comm.rank,
            size=comm.world_size,
            epoch=comm.epoch,
            exact=bool(np.all(body == expected)),
            got=float(body[0]),
            expected=expected,
            dt=round(dt, 4),
        )
        if x[-1] > 0:
            break
        if args.pause > 0:
            emit("between", i=i)
            if point.between and point.iteration and i >= point.iteration:
                point.stop("between", "between")
            await asyncio.sleep(args.pause)
    emit("done", i=i, stats=comm.statistics(), epoch=comm.epoch, size=comm.world_size)
    return 0


async def watch(comm: dsml.Communicator) -> None:
    """Print `disconnect` when the transport saw a peer's connection drop (polled)."""
    seen = comm.statistics()["disconnects"]
    while True:
        await asyncio.sleep(0.005)
        now = comm.statistics()["disconnects"]
        if now > seen:
            emit("disconnect", count=now)
            seen = now


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--registry", required=True)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--mib", type=float, default=8.0, help="array size in MiB (float32)")
    p.add_argument("--algorithm", default="ring")
    p.add_argument("--chunk-bytes", type=int, default=dsml.CommConfig().chunk_bytes)
    p.add_argument("--pause", type=float, default=0.0, help="seconds to sleep between calls")
    p.add_argument("--stop-file", default=None)
    p.add_argument("--max-seconds", type=float, default=60.0)
    p.add_argument("--timeout", type=float, default=30.0, help="collective timeout")
    p.add_argument("--view-timeout", type=float, default=30.0)
    p.add_argument("--stop-at", default=None, help="ITER:STEP or ITER:between")
    p.add_argument("--log", default=None, help="log dsml at this level to stderr (DEBUG, INFO)")
    return p.parse_args(argv)


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main(parse())))
    except BrokenPipeError:  # the test that read our output is gone
        sys.exit(4)
