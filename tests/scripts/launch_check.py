"""A rank whose only setup is `dsml.init()`: prints one JSON line about its group.

argv[1] names the launcher's rank variable (RANK, PMI_RANK, SLURM_PROCID, ...), so the
test can compare comm.rank with it.
"""

import asyncio
import json
import os
import sys

import numpy as np

import dsml


async def main() -> None:
    async with dsml.init() as comm:
        x = np.arange(1000, dtype=np.int64) * (comm.rank + 1)
        await comm.all_reduce(x)
        ranks = await comm.all_gather(np.array([comm.rank], dtype=np.int64))
        report = {
            "rank": comm.rank,
            "world_size": comm.world_size,
            "launcher_rank": int(os.environ[sys.argv[1]]),
            "sum_ok": bool((x == np.arange(1000) * sum(range(1, comm.world_size + 1))).all()),
            "ranks": ranks.tolist(),
            "epoch": comm.epoch,
            "address": comm.address,
        }
        # One write of one line: ranks of torchrun and mpiexec share the launcher's stdout.
        os.write(1, ("LAUNCH " + json.dumps(report) + "\n").encode())


asyncio.run(main())
