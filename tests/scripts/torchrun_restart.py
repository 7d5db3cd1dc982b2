"""A rank under `torchrun --max-restarts 1`: in the first attempt rank 1 dies after one
all_reduce; in the second every rank makes two. Prints `RESTART {json}` per call."""

import asyncio
import json
import os

import numpy as np

import dsml


async def main() -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    async with dsml.init() as comm:
        x = np.full(4, comm.rank + 1.0, dtype=np.float32)
        for call in (1, 2):
            await comm.all_reduce(x)
            report = {"attempt": attempt, "rank": comm.rank, "call": call, "value": float(x[0])}
            os.write(1, f"RESTART {json.dumps(report)}\n".encode())  # one write: shared stdout
            if attempt == 0 and comm.rank == 1:
                os._exit(3)  # a crash: torchrun restarts every rank


asyncio.run(main())
