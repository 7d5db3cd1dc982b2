"""Join, say ready, then wait in a recv that nothing answers, until interrupted (Ctrl-C).

Nothing catches KeyboardInterrupt: what the rank prints is dsml's report of it."""

import asyncio
import os

import dsml


async def main() -> None:
    async with dsml.init() as comm:
        await comm.barrier()  # every rank joined
        print(f"ready {os.getpid()}", flush=True)
        await comm.recv((comm.rank + 1) % comm.world_size, tag=7)


asyncio.run(main())
