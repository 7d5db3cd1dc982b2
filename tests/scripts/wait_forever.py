"""Join, print our pid, then wait until interrupted (for signal-forwarding tests)."""

import asyncio
import os

import dsml


async def main() -> None:
    async with dsml.init() as comm:
        await comm.barrier()  # every rank joined: a signal now finds no collective running
        print(f"ready {os.getpid()}", flush=True)
        await asyncio.Event().wait()


try:
    asyncio.run(main())
except KeyboardInterrupt:
    print(f"interrupted {os.getpid()}", flush=True)
    raise SystemExit(130) from None
