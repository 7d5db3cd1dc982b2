"""Every rank calls all_reduce, rank r with an array of r + 2 elements: a mismatch."""

import asyncio

import numpy as np

import dsml


async def main() -> None:
    async with dsml.init() as comm:
        await comm.barrier()
        await comm.all_reduce(np.ones(comm.rank + 2))


asyncio.run(main())
