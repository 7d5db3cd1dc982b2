"""Hierarchical all_reduce against the flat algorithms, several ranks per namespaced host.

    sudo python benchmarks/hierarchical.py                    # 2 hosts x 2 ranks, 1gbit
    sudo python benchmarks/hierarchical.py --hosts 2 --per-host 2 --rate 1gbit \\
        --sizes 4K,64K,1M,16M --repeat 3

Builds `--hosts` network-namespace hosts (dsml.testing.netns, links shaped with tbf) and
runs `--per-host` ranks on each (`dsml run --nnodes`): the ranks of one host share its
memory, the hosts reach each other only over their links. In each group, every size is
timed with each algorithm in turn (hierarchical, ring, mesh, naive, auto), call by call
interleaved so noise hits all alike; a call's time is the slowest rank's. Prints, per
size, the median over repeats of each algorithm's median call time with the spread, and
what `auto` ran. A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, os.environ.get("DSML_BENCH_TREE") or str(HERE.parent))  # --baseline

ALGORITHMS = ("hierarchical", "ring", "mesh", "naive", "auto")
PORT = 29541  # inside our own namespaces


def calls_for(nbytes: int) -> int:
    return 30 if nbytes <= 1 << 20 else 8


async def worker(sizes: list[int]) -> None:
    import dsml

    async with dsml.init() as comm:
        for nbytes in sizes:
            x = np.ones(nbytes // 4, dtype=np.float32)
            for algorithm in ALGORITHMS:  # warm-up (and auto's probe)
                await comm.all_reduce(x, algorithm=algorithm)
            times = np.empty((len(ALGORITHMS), calls_for(nbytes)))
            ran = ""
            for i in range(times.shape[1]):
                for a, algorithm in enumerate(ALGORITHMS):
                    await comm.barrier()
                    start = time.perf_counter()
                    await comm.all_reduce(x, algorithm=algorithm)
                    times[a, i] = time.perf_counter() - start
                    if algorithm == "auto":
                        ran = comm.stats()[-1]["algorithm"]
            await comm.all_reduce(times, "max")
            if comm.rank == 0:
                row = {a: float(np.median(times[k])) for k, a in enumerate(ALGORITHMS)}
                print("HIER_ROW " + json.dumps({"bytes": nbytes, "ran": ran, **row}), flush=True)


async def turns_worker(small: int, big: int) -> None:
    """What the shared-memory turns of multi-host auto calls cost (`--turns`).

    A multi-host auto call takes a turn in the shared-memory link's queue when
    `hierarchical` is eligible, whatever it then runs. Rank 0 prints: the turns still held
    after 200 auto calls of `small` bytes that ran over TCP; auto against the algorithm it
    ran, call by call; and `small` and `big` issued together (gather), the small one auto
    or named, the big one auto (hierarchical).
    """
    import dsml

    async with dsml.init() as comm:
        x, y = np.ones(small // 4, np.float32), np.ones(big // 4, np.float32)
        await comm.all_reduce(x)
        await comm.all_reduce(y)
        ran = comm.all_reduce_choice(small).algorithm
        shm = comm._session.shm  # private: the turns it holds (None with DSML_SHM=0)
        held = len(shm._claimed) if shm is not None else 0
        for _ in range(200):
            await comm.all_reduce(x)
        held_after = len(shm._claimed) if shm is not None else 0
        times = np.empty((4, 30))
        for i in range(times.shape[1]):
            order = [(0, "auto"), (1, ran)]  # each first in every other round (warm caches)
            for a, name in order if i % 2 else order[::-1]:
                await comm.barrier()
                start = time.perf_counter()
                await comm.all_reduce(x, algorithm=name)
                times[a, i] = time.perf_counter() - start
            for a, name in ((2, "auto"), (3, ran)):
                await comm.barrier()
                start = time.perf_counter()
                await asyncio.gather(comm.all_reduce(x, algorithm=name), comm.all_reduce(y))
                times[a, i] = time.perf_counter() - start
        await comm.all_reduce(times, "max")
        if comm.rank == 0:
            med = [float(np.median(t)) * 1e3 for t in times]
            row = {"small": small, "big": big, "ran": ran, "held": [held, held_after]}
            names = ("auto", "named", "together_auto", "together_named")
            row.update(zip(names, med, strict=True))
            row["chunk"] = comm.all_reduce_choice(small).chunk_bytes
            print("HIER_TURNS " + json.dumps(row), flush=True)


def one_group(
    hosts, per_host: int, sizes: list[int], turns: bool = False, pythonpath: str = ""
) -> list[dict]:
    registry = f"tcp://{hosts[0].address}:{PORT}"
    argv = [sys.executable, "-m", "dsml", "run", "-n", str(per_host), "--nnodes", str(len(hosts))]
    csv = ",".join(map(str, sizes))
    tree = os.environ.get("PYTHONPATH") or str(HERE.parent)
    worker, tag = ("--turns-worker", "HIER_TURNS ") if turns else ("--worker", "HIER_ROW ")
    procs = [
        host.popen(
            [*argv, "--node-rank", str(i), "--registry", registry, __file__, worker, csv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "DSML_BENCH_TREE": pythonpath, "PYTHONPATH": pythonpath or tree},
            cwd=pythonpath or None,  # `python -m` imports from the working directory first
        )
        for i, host in enumerate(hosts)
    ]
    outs = [p.communicate(timeout=1200)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"a host's launcher failed:\n{out}")
    return [json.loads(line.split(tag, 1)[1]) for line in outs[0].splitlines() if tag in line]


def parse_size(text: str) -> int:
    scale = {"K": 1 << 10, "M": 1 << 20}
    text = text.strip().upper()
    return int(text[:-1]) * scale[text[-1]] if text[-1] in scale else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--turns-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--turns",
        action="store_true",
        help="what auto's shared-memory turns cost (--sizes SMALL,BIG)",
    )
    parser.add_argument("--baseline", default="", help="--turns: also run dsml from this tree")
    parser.add_argument("sizes_csv", nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--per-host", type=int, default=2)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--sizes", default="4K,64K,1M,16M")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.worker:
        asyncio.run(worker([int(s) for s in args.sizes_csv.split(",")]))
        return
    if args.turns_worker:
        small, big = (int(s) for s in args.sizes_csv.split(","))
        asyncio.run(turns_worker(small, big))
        return
    from dsml.testing.netns import netns_hosts

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    runs: list[list[dict]] = []
    with netns_hosts(args.hosts, rate=args.rate) as hosts:
        for r in range(args.repeat if not args.turns else 0):
            runs.append(one_group(hosts, args.per_host, sizes))
            print(f"# repeat {r + 1}/{args.repeat} done", file=sys.stderr, flush=True)
        trees = ["", args.baseline] if args.baseline else [""]
        for _ in range(args.repeat if args.turns else 0):
            for tree in trees:  # interleaved: this tree, the baseline, this tree, ...
                for row in one_group(hosts, args.per_host, sizes[:2], True, tree):
                    print(json.dumps({"tree": tree or "this", **row}), flush=True)
    if args.turns:
        return
    print(
        f"# {args.hosts} hosts x {args.per_host} ranks at {args.rate}, float32 sum; median "
        f"call (slowest rank) in ms, median of {args.repeat} runs [min-max]"
    )
    print(f"# {'bytes':>9} " + " ".join(f"{a:>22}" for a in ALGORITHMS) + "  auto ran")
    for k, nbytes in enumerate(sizes):
        cells = []
        for a in ALGORITHMS:
            values = [run[k][a] * 1e3 for run in runs]
            cells.append(f"{statistics.median(values):>8.2f} [{min(values):.2f}-{max(values):.2f}]")
        ran = sorted({run[k]["ran"] for run in runs})
        print(f"  {nbytes:>9} " + " ".join(f"{c:>22}" for c in cells) + "  " + ",".join(ran))


if __name__ == "__main__":
    main()
