"""Two shared-memory all_reduce schedules in one process, alternating call by call.

    DSML_SHM=1 dsml run -n 2 benchmarks/shm_ab.py --baseline ../dsml-main --bytes 16M

Every rank loads `all_reduce_shm` (or, with `--swap reduce_slices`, only the
reduce-scatter half) from the other checkout's `all_reduce_shm.py` next to this tree's,
and alternates them call by call (ABBA order; `--block K`: K calls in a row, the first
untimed, so that each is measured in its own steady state of the caches) on the same
array, so noise from the rest of the machine falls on both alike: that is what tells two
schedules apart on a busy host, where separate runs differ by more than the schedules do.
Rank 0 prints each schedule's median, p10 and p90 call time (the slowest rank's). A
benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import time
from pathlib import Path
from typing import Any

import numpy as np

import dsml
from dsml.collectives import all_reduce_shm
from dsml.communicator import shm_hook


def load_baseline(checkout: str) -> Any:
    path = Path(checkout) / "dsml" / "collectives" / "all_reduce_shm.py"
    spec = importlib.util.spec_from_file_location("dsml.collectives._baseline_shm", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


async def main(args: argparse.Namespace) -> None:
    baseline = load_baseline(args.baseline)
    if args.swap == "reduce_slices":
        schedules = {"baseline": baseline.reduce_slices, "this": all_reduce_shm.reduce_slices}
        owner: Any = all_reduce_shm
    else:
        schedules = {"baseline": baseline.all_reduce_shm, "this": all_reduce_shm.all_reduce_shm}
        owner = shm_hook
    async with dsml.init() as comm:
        x = np.zeros(parse_size(args.bytes) // 4, np.float32)
        for fn in schedules.values():
            setattr(owner, args.swap, fn)
            for _ in range(3):
                await comm.all_reduce(x)
        times: dict[str, list[float]] = {name: [] for name in schedules}
        for i in range(args.calls):
            for name in sorted(schedules, reverse=bool(i % 2)):
                setattr(owner, args.swap, schedules[name])
                for k in range(args.block):
                    await comm.barrier()
                    start = time.perf_counter()
                    await comm.all_reduce(x)
                    if k or args.block == 1:  # in blocks, the first call settles the caches
                        times[name].append(time.perf_counter() - start)
        for name, values in times.items():
            slowest = np.array(values)
            await comm.all_reduce(slowest, "max")
            if comm.rank == 0:
                p10, p50, p90 = np.percentile(slowest, [10, 50, 90]) * 1e3
                print(f"{name:>9}: median {p50:.2f} ms  p10 {p10:.2f}  p90 {p90:.2f}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="another dsml checkout")
    parser.add_argument("--bytes", default="16M")
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument(
        "--block",
        type=int,
        default=1,
        help="calls of one schedule in a row (the first of each untimed): steady state, "
        "as in separate runs, rather than each call after the other schedule's",
    )
    parser.add_argument(
        "--swap", choices=["all_reduce_shm", "reduce_slices"], default="all_reduce_shm"
    )
    asyncio.run(main(parser.parse_args()))
