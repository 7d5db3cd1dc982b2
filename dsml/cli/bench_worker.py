"""One rank of `dsml bench` (run as `python -m dsml.cli.bench_worker`; cli layer).

For every size and algorithm: a few warm-up calls, then timed calls each preceded by a
barrier. A call's time is the slowest rank's. Rank 0 prints one `DSML_BENCH_ROW {json}`
line per measurement for the `dsml bench` command: the 10th, 50th and 90th percentiles of
the call times, the number of timed calls, and the algorithm that ran (for `auto`, the one
it chose).

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
from dsml.collectives import DTYPES


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
) -> tuple[np.ndarray, str]:
    """The time of each of `iters` timed all_reduce calls, the slowest rank's (seconds),
    and the algorithm they ran."""
    x = zeros(comm, nbytes // dtype.itemsize, dtype)
    for _ in range(max(2, iters // 5)):
        await comm.all_reduce(x, op, algorithm=algorithm)
    times = np.empty(iters)
    for i in range(iters):
        await comm.barrier()
        start = time.perf_counter()
        await comm.all_reduce(x, op, algorithm=algorithm)
        times[i] = time.perf_counter() - start
    chosen = chosen_algorithm(comm, algorithm)  # before the max below, which is auto's
    await comm.all_reduce(times, "max")
    return times, chosen


def chosen_algorithm(comm: dsml.Communicator, algorithm: str) -> str:
    """The algorithm the last all_reduce ran, as the communicator recorded it: for `auto`,
    the one it chose; for `shm` with shared memory off, the ring."""
    for record in reversed(comm.stats()):
        if record["kind"] == "all_reduce":
            return str(record["algorithm"] or algorithm)
    return algorithm


def row(
    nbytes: int, size: int, algorithm: str, op: str, times: np.ndarray, chosen: str
) -> dict[str, Any]:
    """One measurement as `dsml bench --json` prints it; bandwidths are at the median."""
    p10, p50, p90 = (float(v) for v in np.percentile(times, [10, 50, 90]))
    algbw = nbytes / p50 / 1e9
    return {
        "bytes": nbytes,
        "world_size": size,
        "algorithm": algorithm,
        "chosen": chosen,
        "op": op,
        "iterations": len(times),
        "p10_s": p10,
        "p50_s": p50,
        "p90_s": p90,
        "median_s": p50,
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * 2 * (size - 1) / size,
    }


async def main(args: argparse.Namespace) -> None:
    dtype = DTYPES[args.dtype]
    config = dsml.CommConfig(gpu_reduce=args.gpu_reduce)
    async with dsml.init(config=config) as comm:
        for nbytes in args.sizes:
            for algorithm in args.algorithms:
                iters = args.iters or iterations(nbytes)
                times, chosen = await measure(comm, nbytes, algorithm, args.op, dtype, iters)
                if comm.rank == 0:
                    result = row(nbytes, comm.world_size, algorithm, args.op, times, chosen)
                    result["device"] = comm.device
                    if comm.device != "cpu":
                        result["gpu_reduce"] = comm.config.gpu_reduce
                    print(ROW_PREFIX + json.dumps(result), flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dsml.cli.bench_worker")
    parser.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")], required=True)
    parser.add_argument("--algorithms", type=lambda s: s.split(","), required=True)
    parser.add_argument("--op", default="sum")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--iters", type=int, default=0)
    parser.add_argument("--gpu-reduce", default="host", choices=("host", "device"))
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
