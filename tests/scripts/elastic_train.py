"""An elastic training loop with an exactly known result (membership fault tests).

    python tests/scripts/elastic_train.py --registry tcp://127.0.0.1:PORT --world-size 4 \
        --steps 300 [--pause 0.02]

`dsml.elastic.run` drives `train`: every step all-reduces an update made of exact
integers (its sum does not depend on how the items are split over the ranks), so the
parameters after step s are the same whatever the group went through, and equal to
`reference(s)` computed here without any group. Events (JSON lines, `t` = time.time()):

  joined  {pid, member, rank, size, epoch}
  step    {step, size, epoch, rank}                  every 10 steps
  restart {step, type, error, size, epoch, rank}     from elastic.run's on_restart
  done    {step, digest, exact, size, epoch, restarts}
  error   {type, error}                              exit code 1

SIGINT closes the communicator (a graceful leave); the process then exits with code 130.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import sys
import threading
import time

import numpy as np

import dsml
from dsml.elastic import State

_lock = threading.Lock()
MOD = 1_000_003
ITEMS = 24


def emit(event: str, **fields: object) -> None:
    with _lock:
        sys.stdout.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
        sys.stdout.flush()


def contribution(params: np.ndarray, step: int, rank: int, size: int) -> np.ndarray:
    out = np.zeros_like(params)
    for item in range(rank, ITEMS, size):
        out += (params * (item + 1) + step * 7 + item) % 101
    return out


def reference(steps: int) -> np.ndarray:
    params = np.arange(8, dtype=np.int64)
    for step in range(steps):
        params = (params * 3 + contribution(params, step, 0, 1)) % MOD
    return params


def digest(params: np.ndarray) -> str:
    return hashlib.sha256(params.tobytes()).hexdigest()[:16]


async def main(args: argparse.Namespace) -> int:
    if args.log:
        logging.basicConfig(
            level=args.log.upper(),
            format="%(asctime)s.%(msecs)03d %(name)s %(levelname)s %(message)s",
            datefmt="%H:%M:%S",
        )
    state = State(params=np.arange(8, dtype=np.int64), step=0)
    restarts: list[str] = []
    config = dsml.CommConfig(timeout=args.timeout, view_timeout=args.view_timeout)

    async def train(comm: dsml.Communicator, state: State) -> np.ndarray:
        if not restarts:
            emit("joined", pid=os.getpid(), member=comm.member_id, rank=comm.rank,
                 size=comm.world_size, epoch=comm.epoch)  # fmt: skip
        while state.step < args.steps:
            update = contribution(state.params, state.step, comm.rank, comm.world_size)
            await comm.all_reduce(update)
            state.params = (state.params * 3 + update) % MOD
            state.step += 1
            state.commit()
            if state.step % 10 == 0:
                emit("step", step=state.step, size=comm.world_size, epoch=comm.epoch,
                     rank=comm.rank)  # fmt: skip
            if args.pause:
                await asyncio.sleep(args.pause)
        emit("done", step=state.step, digest=digest(state.params),
             exact=bool((state.params == reference(state.step)).all()),
             size=comm.world_size, epoch=comm.epoch, restarts=len(restarts))  # fmt: skip
        return state.params

    def on_restart(comm: dsml.Communicator, error: BaseException) -> None:
        restarts.append(type(error).__name__)
        emit("restart", step=state.step, type=type(error).__name__, error=str(error)[:300],
             size=comm.world_size, epoch=comm.epoch, rank=comm.rank)  # fmt: skip

    await dsml.elastic.run(
        train,
        state,
        registry=args.registry,
        world_size=args.world_size,
        min_size=args.min_size,
        config=config,
        on_restart=on_restart,
    )
    return 0


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--registry", required=True)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--min-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--pause", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--view-timeout", type=float, default=30.0)
    p.add_argument("--log", default=None, help="log dsml at this level to stderr (DEBUG, INFO)")
    return p.parse_args()


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main(parse())))
    except KeyboardInterrupt:
        emit("interrupted")
        sys.exit(130)
    except Exception as exc:  # reported as an event: the test reads it
        emit("error", type=type(exc).__name__, error=str(exc)[:500])
        sys.exit(1)
