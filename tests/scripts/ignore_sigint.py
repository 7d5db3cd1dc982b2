"""Join, then ignore SIGINT and wait forever: only SIGKILL ends this rank."""

import asyncio
import os
import signal

import dsml


async def main() -> None:
    async with dsml.init() as comm:
        await comm.barrier()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)
        print(f"ready {os.getpid()}", flush=True)
        await asyncio.Event().wait()


asyncio.run(main())
