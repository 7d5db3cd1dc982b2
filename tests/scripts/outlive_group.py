"""Ranks that close their communicator, then go on without it (writing results): the
ranks of node 1 (ranks 2 and 3 of 4) for argv[1] more seconds. Prints "finished"."""

import asyncio
import sys
import time

import dsml


async def main() -> int:
    async with dsml.init() as comm:
        await comm.barrier()
        rank = comm.rank
    return rank


rank = asyncio.run(main())
if rank >= 2:
    time.sleep(float(sys.argv[1]))
print(f"finished {rank}", flush=True)
