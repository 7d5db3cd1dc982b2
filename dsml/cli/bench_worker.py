"""One rank of `dsml bench` (run as `python -m dsml.cli.bench_worker`; cli layer).

For every size and algorithm: a few warm-up calls, then timed calls each preceded by a
barrier. A call's time is the slowest rank's; the median over calls is reported. Rank 0
prints one `DSML_BENCH_ROW {json}` line per measurement for the `dsml bench` command.

Arrays live on `comm.device` (DSML_DEVICE, set by `dsml bench --device`): numpy on "cpu",
cupy on "cuda:N". A cupy all_reduce returns once the result is back on the GPU, so its
times include the copies through host memory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import numpy as np

import dsml
from dsml.cli.bench import ROW_PREFIX
from dsml.collectives import DTYPES, choose_all_reduce


def iterations(nbytes: int) -> int:
    """Timed calls per size: many for small messages, fewer for large ones."""
    if nbytes <= 64 * 1024:
        return 50
    if nbytes <= 1 << 20:
        return 30
    if nbytes <= 16 << 20:
        return 12
    return 6


def zeros(comm: dsml.Communicator, count: int, dtype: Any) -> Any:
    """The benchmark's array on comm.device: numpy, or cupy under `--device cuda`."""
    if comm.device == "cpu":
        return np.zeros(count, dtype=dtype)
    import cupy  # the device was checked by dsml.init

    with cupy.cuda.Device(int(comm.device.split(":")[1])):
        return cupy.zeros(count, dtype=dtype)


async def measure(
    comm: dsml.Communicator, nbytes: int, algorithm: str, op: str, dtype: Any, iters: int
) -> float:
    x = zeros(comm, nbytes // dtype.itemsize, dtype)
    for _ in range(max(2, iters // 5)):
        await comm.all_reduce(x, op, algorithm=algorithm)
    times = np.empty(iters)
    for i in range(iters):
        await comm.barrier()
        start = time.perf_counter()
        await comm.all_reduce(x, op, algorithm=algorithm)
        times[i] = time.perf_counter() - start
    await comm.all_reduce(times, "max")
    return float(np.median(times))


def row(nbytes: int, size: int, algorithm: str, op: str, median_s: float) -> dict[str, Any]:
    algbw = nbytes / median_s / 1e9
    resolved = choose_all_reduce(nbytes, size) if algorithm == "auto" else algorithm
    return {
        "bytes": nbytes,
        "world_size": size,
        "algorithm": algorithm,
        "resolved": resolved,
        "op": op,
        "median_s": median_s,
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * 2 * (size - 1) / size,
    }


async def main(args: argparse.Namespace) -> None:
    dtype = DTYPES[args.dtype]
    async with dsml.init() as comm:
        for nbytes in args.sizes:
            for algorithm in args.algorithms:
                iters = args.iters or iterations(nbytes)
                median = await measure(comm, nbytes, algorithm, args.op, dtype, iters)
                if comm.rank == 0:
                    result = row(nbytes, comm.world_size, algorithm, args.op, median)
                    result["device"] = comm.device
                    print(ROW_PREFIX + json.dumps(result), flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dsml.cli.bench_worker")
    parser.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")], required=True)
    parser.add_argument("--algorithms", type=lambda s: s.split(","), required=True)
    parser.add_argument("--op", default="sum")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--iters", type=int, default=0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
