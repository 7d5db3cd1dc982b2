"""Rank HANG_RANK blocks its event loop (a long computation, a deadlock in C) before its
second all_reduce; the others time out after CALL_TIMEOUT seconds. `dsml run` must name it."""

import asyncio
import os
import time

import numpy as np

import dsml


async def main() -> None:
    async with dsml.init(timeout=float(os.environ.get("CALL_TIMEOUT", "4"))) as comm:
        x = np.ones(4)
        await comm.all_reduce(x)
        if comm.rank == int(os.environ["HANG_RANK"]):
            time.sleep(120)  # noqa: ASYNC251 (the point: its loop answers no probes now)
        await comm.all_reduce(x)


asyncio.run(main())
