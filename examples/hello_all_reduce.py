"""Every rank all-reduces an array and says what it did.

    dsml run -n 4 examples/hello_all_reduce.py
    dsml run --device cuda -n 2 examples/hello_all_reduce.py     # cupy arrays on GPUs

`dsml run` starts the processes and an embedded registry; `dsml.init()` reads the registry
address, the world size and the device from the environment it sets.
"""

import asyncio
import time
from typing import Any

import numpy as np

import dsml


def array_module(comm: dsml.Communicator) -> Any:
    """numpy on "cpu", cupy under `--device cuda` (dsml.init made the GPU current)."""
    if comm.device == "cpu":
        return np
    import cupy

    return cupy


async def main() -> None:
    async with dsml.init() as comm:
        xp = array_module(comm)  # the same code for numpy and cupy arrays
        x = xp.arange(4, dtype=xp.float32) + comm.rank
        before = x.tolist()
        await comm.all_reduce(x)  # in place, on every rank
        print(f"rank {comm.rank}/{comm.world_size}: all_reduce(sum) of {before} -> {x.tolist()}")

        weights = xp.zeros(3) if comm.rank else xp.array([0.5, 0.25, 0.125])
        await comm.broadcast(weights, root=0)
        ranks = await comm.all_gather(xp.array([comm.rank]))
        print(
            f"rank {comm.rank}: broadcast from 0 -> {weights.tolist()}, "
            f"all_gather of ranks -> {ranks.tolist()}"
        )

        big = xp.ones(4 << 20, dtype=xp.float32)  # 16 MiB
        await comm.barrier()
        start = time.perf_counter()
        await comm.all_reduce(big, "avg")
        elapsed = time.perf_counter() - start
        if comm.rank == 0:
            print(
                f"rank 0: 16 MiB all_reduce(avg) on {comm.device} took {elapsed * 1e3:.1f} ms, "
                f"every element is {float(big[0])}"
            )


if __name__ == "__main__":
    asyncio.run(main())
