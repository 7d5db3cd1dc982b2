"""One rank of the IPv6 tests: exact all_reduces, then one JSON line about its group.

    dsml run -n 4 --registry tcp://[::1]:PORT tests/scripts/ipv6_check.py

Prints `IPV6 {"rank", "world_size", "address", "exact", "ran", "shm_ran"}`: the address the rank
advertises, whether every sum was exact, the algorithm the largest call ran, and what a call that
asked for shared memory ran (`shm` only when the ranks know they share the host).
"""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np

import dsml


async def main() -> None:
    async with dsml.init() as comm:
        size = comm.world_size
        exact = True
        for n in (0, 1, size - 1, 1000, 1 << 20):  # the last is 8 MiB: large enough for shm
            x = np.arange(n, dtype=np.int64) * (comm.rank + 1)
            await comm.all_reduce(x)
            exact &= bool(np.array_equal(x, np.arange(n) * (size * (size + 1) // 2)))
        ran = comm.stats()[-1]["algorithm"]
        y = np.ones(1 << 16, dtype=np.int64)
        await comm.all_reduce(y, algorithm="shm")  # falls back to the ring off one host
        exact &= bool((y == size).all())
        report = {
            "rank": comm.rank,
            "world_size": size,
            "address": comm.address,
            "exact": exact,
            "ran": ran,
            "shm_ran": comm.stats()[-1]["algorithm"],
        }
        os.write(1, ("IPV6 " + json.dumps(report) + "\n").encode())


asyncio.run(main())
