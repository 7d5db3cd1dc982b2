"""Every rank all-reduces an array and says what it did.

    dsml run -n 4 examples/hello_all_reduce.py

`dsml run` starts 4 processes and an embedded registry; `dsml.init()` reads the registry
address and the world size from the environment it sets.
"""

import asyncio
import time

import numpy as np

import dsml


async def main() -> None:
    async with dsml.init() as comm:
        x = np.arange(4, dtype=np.float32) + comm.rank
        before = x.tolist()
        await comm.all_reduce(x)  # in place, on every rank
        print(f"rank {comm.rank}/{comm.world_size}: all_reduce(sum) of {before} -> {x.tolist()}")

        weights = np.zeros(3) if comm.rank else np.array([0.5, 0.25, 0.125])
        await comm.broadcast(weights, root=0)
        ranks = await comm.all_gather(np.array([comm.rank]))
        print(
            f"rank {comm.rank}: broadcast from 0 -> {weights.tolist()}, "
            f"all_gather of ranks -> {ranks.tolist()}"
        )

        big = np.ones(4 << 20, dtype=np.float32)  # 16 MiB
        await comm.barrier()
        start = time.perf_counter()
        await comm.all_reduce(big, "avg")
        elapsed = time.perf_counter() - start
        if comm.rank == 0:
            print(
                f"rank 0: 16 MiB all_reduce(avg) took {elapsed * 1e3:.1f} ms, "
                f"every element is {big[0]}"
            )


if __name__ == "__main__":
    asyncio.run(main())
