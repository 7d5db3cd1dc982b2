"""Rank FAIL_RANK raises before the collective; the others wait in it."""

import asyncio
import os

import numpy as np

import dsml


async def main() -> None:
    async with dsml.init() as comm:
        await comm.barrier()
        if comm.rank == int(os.environ.get("FAIL_RANK", "2")):
            raise RuntimeError(f"rank {comm.rank} cannot find its batch")
        await comm.all_reduce(np.ones(8))


asyncio.run(main())
