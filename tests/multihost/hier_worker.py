"""One rank of a hierarchical all_reduce test: several ranks on each namespaced host.

    python tests/multihost/hier_worker.py

Started by `dsml run -n L --nnodes H` on every host. For each algorithm (`hierarchical`,
`ring` as the reference, and `auto`, which may pick either) and each size, reduces
`arange(n) * (rank + 1)` (float64, integer-valued, so every summation order is exact),
checks the sum and the max, and
prints one JSON line per call: {event: "ok", algorithm, ran, n, op, exact} where `ran` is
what comm.stats() says ran. Ends with {event: "done"}.
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np

import dsml

SIZES = (1, 1000, 3 * 2**17 + 5)  # one element, under a chunk, 3 MiB and not a multiple


def emit(event: str, **fields: object) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


async def main() -> int:
    async with dsml.init() as comm:
        rank, size = comm.rank, comm.world_size
        emit("joined", rank=rank, size=size)
        for algorithm in ("hierarchical", "ring", "auto"):
            for n in SIZES:
                for op, expected in (
                    ("sum", np.arange(n, dtype=np.float64) * (size * (size + 1) // 2)),
                    ("max", np.arange(n, dtype=np.float64) * size),
                ):
                    x = np.arange(n, dtype=np.float64) * (rank + 1)
                    await comm.all_reduce(x, op=op, algorithm=algorithm)
                    ran = comm.stats()[-1]["algorithm"]
                    exact = bool(np.array_equal(x, expected))
                    emit("ok", algorithm=algorithm, ran=ran, n=n, op=op, exact=exact)
        emit("done")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
