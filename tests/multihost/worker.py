"""One rank on a namespaced host: `dsml.init()` with no arguments, exact all_reduces.

    python tests/multihost/worker.py [--calls N] [--until-lost [--after-lost K]] [--mib M]
                                     [--algorithm NAME]

Whatever launched it (`dsml run`, MASTER_*/RANK/WORLD_SIZE, SLURM_*, DSML_*) must have
set the variables; this script passes nothing to `dsml.init()`. Each call reduces
`arange(n) * (rank + 1)` (float64, integer-valued, so every summation order is exact) and
checks the result against `arange(n) * P(P+1)/2`. Prints one JSON line per event:

  joined {rank, size, host, address, pid, env}   address: this rank's advertised endpoint;
                                             env: the launcher's rank variables
  ok     {i, rank, size, exact, ran}           rank and size of the view the call ran in;
                                             ran: the algorithm comm.stats() recorded
  lost   {i, error, lost, t}                 --until-lost: a PeerLostError ended call i
                                             (lost: its ranks; t: time.time() then); with
                                             --after-lost K, K more calls follow
  shrunk {i, size, t}                        --until-lost: the loss was learnt between two
                                             calls (call i already runs without it)
  error  {i, type, error}                    any other dsml error (exit code 1)
  done   {i}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time

import numpy as np

import dsml

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NODEID")


def emit(event: str, **fields: object) -> None:
    # One write per line: ranks of one host share the pipe (torchrun), unbuffered.
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


async def main(args: argparse.Namespace) -> int:
    async with dsml.init() as comm:
        launcher = {name: os.environ.get(name) for name in LAUNCHER_VARIABLES}
        emit(
            "joined",
            rank=comm.rank,
            size=comm.world_size,
            host=socket.gethostname(),
            address=getattr(comm, "address", None),
            pid=os.getpid(),
            env=launcher,
        )
        calls, i, joined_size = args.calls, 0, comm.world_size
        while args.until_lost or i < calls:
            i += 1
            rank, size = comm.rank, comm.world_size  # renumbered after a loss
            if args.until_lost and size < joined_size:  # learnt between two calls
                emit("shrunk", i=i, size=size, t=time.time())
                args.until_lost, calls = False, i - 1 + args.after_lost
                if not args.after_lost:
                    return 0
            x = np.arange(args.n, dtype=np.float64) * (rank + 1)
            try:
                await comm.all_reduce(x, algorithm=args.algorithm)
            except dsml.PeerLostError as exc:
                emit("lost", i=i, error=str(exc), lost=list(exc.lost), t=time.time())
                if not args.after_lost:
                    return 0
                args.until_lost, calls = False, i + args.after_lost
                continue
            except dsml.DsmlError as exc:
                emit("error", i=i, type=type(exc).__name__, error=str(exc))
                return 1
            expected = np.arange(args.n, dtype=np.float64) * (size * (size + 1) // 2)
            exact = bool(np.array_equal(x, expected))
            ran = comm.stats()[-1]["algorithm"]
            emit("ok", i=i, rank=rank, size=size, exact=exact, ran=ran)
        emit("done", i=i)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--until-lost", action="store_true")
    parser.add_argument("--after-lost", type=int, default=0, help="calls to make after a loss")
    parser.add_argument("--mib", type=float, default=1.0, help="array size in MiB (float64)")
    parser.add_argument("--algorithm", default="auto", help="all_reduce algorithm")
    arguments = parser.parse_args()
    arguments.n = max(1, int(arguments.mib * (1 << 20)) // 8)
    sys.exit(asyncio.run(main(arguments)))
