"""One rank of the small-/dev/shm test: exact all_reduces of growing arrays.

    dsml run -n 4 tests/scripts/shm_room.py 1 16 48     # sizes in MiB

Each call reduces `arange(n) * (rank + 1)` (float64, integer-valued: exact in any order)
and prints one JSON line {event: "ok", mib, exact, ran} where `ran` is the algorithm
comm.stats() recorded; then {event: "done"}.
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np

import dsml


async def main(sizes_mib: list[int]) -> None:
    async with dsml.init() as comm:
        size = comm.world_size
        for mib in sizes_mib:
            n = (mib << 20) // 8
            x = np.arange(n, dtype=np.float64) * (comm.rank + 1)
            await comm.all_reduce(x)
            exact = bool(
                np.array_equal(x, np.arange(n, dtype=np.float64) * (size * (size + 1) // 2))
            )
            ran = comm.stats()[-1]["algorithm"]
            print(json.dumps({"event": "ok", "mib": mib, "exact": exact, "ran": ran}), flush=True)
        print(json.dumps({"event": "done"}), flush=True)


if __name__ == "__main__":
    asyncio.run(main([int(a) for a in sys.argv[1:]]))
