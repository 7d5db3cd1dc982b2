"""Per-call cost of a small all_reduce: wall time and each rank's CPU time (a benchmark).

    dsml run -n 4 benchmarks/percall.py --bytes 4096 --calls 2000 [--profile out.prof]

Each rank runs warm-up calls, then `--calls` back-to-back all_reduce calls (no barrier
between them), and rank 0 prints one `PERCALL {json}` line: wall microseconds per call
and the CPU microseconds per call of every rank (`time.process_time`, all threads). On a
machine with fewer cores than ranks, CPU time per call is what bounds latency. With
`--profile PATH`, rank 0 runs the timed calls under cProfile and writes PATH. A benchmark:
nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import time
from pathlib import Path

import numpy as np

import dsml


async def main(args: argparse.Namespace) -> None:
    async with dsml.init() as comm:
        x = np.zeros(args.bytes // 4, dtype=np.float32)
        for _ in range(args.warmup):
            await comm.all_reduce(x, algorithm=args.algorithm)
        if args.pidfile and comm.rank == 0:  # for a sampling profiler (py-spy --pid)
            Path(args.pidfile).write_text(str(os.getpid()))  # noqa: ASYNC240 (before timing)
        await comm.barrier()
        profile = cProfile.Profile() if args.profile and comm.rank == 0 else None
        cpu0, wall0 = time.process_time(), time.perf_counter()
        if profile is not None:
            profile.enable()
        for _ in range(args.calls):
            await comm.all_reduce(x, algorithm=args.algorithm)
        if profile is not None:
            profile.disable()
            profile.dump_stats(args.profile)
        wall = (time.perf_counter() - wall0) / args.calls
        cpu = (time.process_time() - cpu0) / args.calls
        cpus = await comm.all_gather(np.array([cpu]))
        if comm.rank == 0:
            row = {
                "world_size": comm.world_size,
                "bytes": args.bytes,
                "algorithm": args.algorithm,
                "wall_us": wall * 1e6,
                "cpu_us": [round(c * 1e6, 1) for c in cpus.tolist()],
            }
            print("PERCALL " + json.dumps(row), flush=True)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="percall")
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--algorithm", default="auto")
    parser.add_argument("--profile", default="")
    parser.add_argument("--pidfile", default="", help="rank 0 writes its PID here")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse()))
