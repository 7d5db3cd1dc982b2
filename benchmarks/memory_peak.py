"""Peak memory of one rank during a 64 MiB all_reduce, per algorithm (a benchmark).

    python benchmarks/memory_peak.py -n 4

Each rank allocates and touches its 64 MiB array, notes its peak RSS, runs two
all_reduces and notes the peak again; the growth is what dsml needed on top of the array.
Prints the worst rank's total (array + growth) as a multiple of the array. A benchmark: it
asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import resource

import numpy as np
from common import dsml, tagged_lines

ARRAY_BYTES = 64 << 20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


async def worker(algorithm: str) -> None:
    import dsml

    async with dsml.init() as comm:
        x = np.ones(ARRAY_BYTES // 4, dtype=np.float32)
        await comm.barrier()
        before = peak_mib()
        for _ in range(2):
            await comm.all_reduce(x, algorithm=algorithm)
        growth = np.array([peak_mib() - before])
        await comm.all_reduce(growth, "max")
        if comm.rank == 0:
            total = 1 + growth[0] * (1 << 20) / ARRAY_BYTES
            print(f"MEMORY {algorithm} {comm.world_size} {growth[0]:.0f} {total:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=4)
    parser.add_argument("--algorithms", default="auto,ring,mesh,tree,naive,direct")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        asyncio.run(worker(args.worker))
        return
    print(f"# world_size={args.n}, 64 MiB float32 all_reduce; peak RSS of the worst rank")
    print(f"# {'algorithm':>9} {'growth MiB':>11} {'total / array':>14}")
    for algorithm in args.algorithms.split(","):
        out = dsml("run", "-n", str(args.n), __file__, "--worker", algorithm)
        name, _world, growth, total = tagged_lines(out, "MEMORY")[0].split()[:4]
        print(f"  {name:>9} {float(growth):>11.0f} {float(total):>13.2f}x")


if __name__ == "__main__":
    main()
