"""One rank on a namespaced host: `dsml.init()` with no arguments, exact all_reduces.

    python tests/multihost/worker.py [--calls N] [--until-lost] [--mib M]

Whatever launched it (`dsml run`, MASTER_*/RANK/WORLD_SIZE, SLURM_*, DSML_*) must have
set the variables; this script passes nothing to `dsml.init()`. Each call reduces
`arange(n) * (rank + 1)` (float64, integer-valued, so every summation order is exact) and
checks the result against `arange(n) * P(P+1)/2`. Prints one JSON line per event:

  joined {rank, size, host, address, pid}   address: this rank's advertised endpoint
  ok     {i, rank, exact}
  lost   {i, error, t}                       --until-lost: a PeerLostError ended call i
                                             (t: time.time() when it was raised)
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


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


async def main(args: argparse.Namespace) -> int:
    n = max(1, int(args.mib * (1 << 20)) // 8)
    async with dsml.init() as comm:
        rank, size = comm.rank, comm.world_size
        address = getattr(comm, "address", None)
        emit(
            "joined",
            rank=rank,
            size=size,
            host=socket.gethostname(),
            address=address,
            pid=os.getpid(),
        )
        expected = np.arange(n, dtype=np.float64) * (size * (size + 1) // 2)
        i = 0
        while args.until_lost or i < args.calls:
            i += 1
            x = np.arange(n, dtype=np.float64) * (rank + 1)
            try:
                await comm.all_reduce(x)
            except dsml.PeerLostError as exc:
                emit("lost", i=i, error=str(exc), t=time.time())
                return 0
            emit("ok", i=i, rank=rank, exact=bool(np.array_equal(x, expected)))
        emit("done", i=i)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--until-lost", action="store_true")
    parser.add_argument("--mib", type=float, default=1.0, help="array size in MiB (float64)")
    sys.exit(asyncio.run(main(parser.parse_args())))
