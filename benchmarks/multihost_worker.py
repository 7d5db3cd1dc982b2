"""One rank of benchmarks/multihost.py, on one namespaced host (a benchmark helper).

    python benchmarks/multihost_worker.py dsml --sizes 4096,1048576 --algorithms auto,ring
    python benchmarks/multihost_worker.py gloo --sizes 4096,1048576 --master 10.217.44.1:29500

`dsml` joins the group named by DSML_REGISTRY / DSML_WORLD_SIZE / DSML_RANK; `gloo` joins
torch.distributed (Gloo, over eth0) at --master with RANK / WORLD_SIZE. Both time
float32 sum all_reduce the same way: warm-up calls, then timed calls each preceded by a
barrier, a call's time being the slowest rank's; the number of timed calls is chosen from
the warm-up so each measurement takes about --budget seconds (3 to 50 calls; every rank
uses rank 0's count). dsml's algorithms at one size are timed interleaved, call by call,
so that they meet the same spells of a busy machine. Rank 0 prints one `MULTIHOST_ROW
{json}` line per measurement, and for dsml the measured cost model (`MULTIHOST_MODEL`)
once it exists.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

TAG_ROW, TAG_MODEL = "MULTIHOST_ROW ", "MULTIHOST_MODEL "
#: rank 0's CPU seconds (user, system) per timed call of the last measurement (Gloo:
#: barriers included; dsml: the call alone), its own threads' (not the kernel's softirq
#: work done on its behalf elsewhere)
CPU_PER_CALL = [0.0, 0.0]


def calls_for(warm_s: float, budget_s: float) -> int:
    return int(min(50, max(3, budget_s / max(warm_s, 1e-6))))


def row(nbytes: int, size: int, algorithm: str, times: np.ndarray, **extra: Any) -> str:
    median = float(np.median(times))
    algbw = nbytes / median / 1e9
    fields = {
        "bytes": nbytes,
        "world_size": size,
        "algorithm": algorithm,
        "median_s": median,
        "p10_s": float(np.percentile(times, 10)),
        "p90_s": float(np.percentile(times, 90)),
        "times_s": [round(float(t), 7) for t in times],
        "calls": len(times),
        "busbw_GBps": algbw * 2 * (size - 1) / size,
        "cpu_user_s": CPU_PER_CALL[0],
        "cpu_sys_s": CPU_PER_CALL[1],
        **extra,
    }
    return TAG_ROW + json.dumps(fields)


async def dsml_side(args: argparse.Namespace) -> None:
    import dsml
    from dsml.config import CommConfig

    config = CommConfig(chunk_bytes=args.chunk_bytes) if args.chunk_bytes else None
    async with dsml.init(config=config) as comm:
        start = time.perf_counter()
        await comm.all_reduce(np.zeros(1, np.float32))  # the view's first auto call: the probe
        probe_s = time.perf_counter() - start
        for nbytes in args.sizes:
            arrays = [np.zeros(nbytes // 4, dtype=np.float32) for _ in args.algorithms]
            onces = [
                _call(comm, x, algorithm)
                for x, algorithm in zip(arrays, args.algorithms, strict=True)
            ]
            timed = await _timed_together(onces, comm.barrier, _dsml_max(comm), args.budget)
            if comm.rank == 0:
                choice = comm.all_reduce_choice(nbytes)
                chosen = {"chosen": choice.algorithm, "chunk_bytes": choice.chunk_bytes}
                for algorithm, (times, cpu) in zip(args.algorithms, timed, strict=True):
                    CPU_PER_CALL[:] = cpu
                    extra = chosen if algorithm == "auto" else {}
                    print(row(nbytes, comm.world_size, algorithm, times, **extra), flush=True)
            model = comm.cost_model
            if comm.rank == 0 and model is not None and nbytes == args.sizes[0]:
                fields = {**model.to_fields(), "probe_s": probe_s}
                print(TAG_MODEL + json.dumps(fields), flush=True)


def _call(comm: Any, x: np.ndarray, algorithm: str) -> Callable[[], Awaitable[None]]:
    async def once() -> None:
        await comm.all_reduce(x, algorithm=algorithm)

    return once


async def _timed_together(
    onces: list[Callable[[], Awaitable[None]]],
    barrier: Callable[[], Awaitable[None]],
    reduce_max: Callable[[np.ndarray], Awaitable[np.ndarray]],
    budget_s: float,
) -> list[tuple[np.ndarray, list[float]]]:
    """Time several ways of making the call, interleaved call by call (A, B, C, A, B, C,
    ...), so that the machine's slow and fast spells fall on each alike: on 2 shared cores
    the medians of blocks of calls timed one way after the other differed by up to 2x from
    run to run at 4-256 KiB, which no 10% comparison survives. Each round takes the ways in
    another order (shuffled, seeded by the round: alike on every rank), so each way
    follows each other alike: what a call leaves behind (the shapers' token buckets
    emptied by direct's 768 KiB per rank at 256 KiB) fell on the way that always came
    next, 8-11% slower there. Per way: (the slowest rank's
    time of each call, rank 0's CPU seconds per call, user and system)."""
    warm = np.zeros(len(onces))
    for _ in range(2):
        for j, once in enumerate(onces):
            await barrier()
            start = time.perf_counter()
            await once()
            warm[j] = time.perf_counter() - start
    await reduce_max(warm)
    calls = calls_for(float(warm.sum()), budget_s * len(onces))
    times = np.empty((len(onces), calls))
    cpu = np.zeros((len(onces), 2))
    ways = len(onces)
    for i in range(calls):
        for j in random.Random(i).sample(range(ways), ways):  # the same order on every rank
            once = onces[j]
            await barrier()
            before = os.times()
            start = time.perf_counter()
            await once()
            times[j, i] = time.perf_counter() - start
            after = os.times()
            cpu[j] += (after.user - before.user, after.system - before.system)
    await reduce_max(times)
    return [(times[j], list(cpu[j] / calls)) for j in range(len(onces))]


def _dsml_max(comm: Any) -> Callable[[np.ndarray], Awaitable[np.ndarray]]:
    async def reduce_max(values: np.ndarray) -> np.ndarray:
        return await comm.all_reduce(values, "max", algorithm="tree")  # type: ignore[no-any-return]

    return reduce_max


async def _timed(
    once: Callable[[], Awaitable[None]],
    barrier: Callable[[], Awaitable[None]],
    reduce_max: Callable[[np.ndarray], Awaitable[np.ndarray]],
    budget_s: float,
) -> np.ndarray:
    """Warm up (2 calls), agree on a call count, then time that many calls."""
    warm = np.zeros(1)
    for _ in range(2):
        await barrier()
        start = time.perf_counter()
        await once()
        warm[0] = time.perf_counter() - start
    await reduce_max(warm)
    calls = calls_for(float(warm[0]), budget_s)
    times = np.empty(calls)
    cpu = os.times()
    for i in range(calls):
        await barrier()
        start = time.perf_counter()
        await once()
        times[i] = time.perf_counter() - start
    spent = os.times()
    CPU_PER_CALL[0] = (spent.user - cpu.user) / calls
    CPU_PER_CALL[1] = (spent.system - cpu.system) / calls
    await reduce_max(times)
    return times


def gloo_side(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=rank, world_size=size)

    async def barrier() -> None:
        dist.barrier()

    async def reduce_max(values: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(values)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return values

    for nbytes in args.sizes:
        x = torch.zeros(nbytes // 4, dtype=torch.float32)

        async def once(x: Any = x) -> None:
            dist.all_reduce(x)

        times = asyncio.run(_timed(once, barrier, reduce_max, args.budget))
        if rank == 0:
            print(row(nbytes, size, "gloo", times), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("side", choices=["dsml", "gloo"])
    parser.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")], required=True)
    parser.add_argument("--algorithms", type=lambda s: s.split(","), default=["auto"])
    parser.add_argument("--master", default="", help="gloo: host:port of rank 0's store")
    parser.add_argument("--chunk-bytes", type=int, default=0, help="dsml: CommConfig.chunk_bytes")
    parser.add_argument("--budget", type=float, default=1.5, help="seconds per measurement")
    args = parser.parse_args()
    if args.side == "dsml":
        asyncio.run(dsml_side(args))
    else:
        gloo_side(args)


if __name__ == "__main__":
    main()
