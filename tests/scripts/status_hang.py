"""A 4-rank job for the live status: rank 2 holds a collective back until RELEASE exists.

Every rank makes BEFORE all_reduce calls (default 2, PAUSE seconds apart, default 0);
then rank 2 holds the next one (#3 by default) back, and ranks 0, 1 and 3 wait in it
meanwhile (as when a rank skipped the call), so `dsml status` can be asked what it sees;
once RELEASE exists every rank makes the call and the job ends well. The timeout is long:
the test, not the call, decides when the wait ends.
"""

import asyncio
import os
import time
from pathlib import Path

import numpy as np

import dsml

STUCK = 2


def wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(0.05)


async def main() -> None:
    release = Path(os.environ["RELEASE"])
    async with dsml.init(timeout=float(os.environ.get("CALL_TIMEOUT", "120"))) as comm:
        x = np.ones(1024)
        before = int(os.environ.get("BEFORE", "2"))
        for _ in range(before):  # collectives #1 .. #before
            await comm.all_reduce(x)
            await asyncio.sleep(float(os.environ.get("PAUSE", "0")))
        if comm.rank == STUCK:
            print(f"rank {comm.rank}: holding collective #{before + 1} back", flush=True)
            await asyncio.to_thread(wait_for, release)  # the loop stays free meanwhile
        await comm.all_reduce(x)  # the others wait here for rank 2
        print(f"rank {comm.rank}: done", flush=True)


asyncio.run(main())
