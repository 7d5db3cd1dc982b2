"""Python function calls per all_reduce of several source trees (a load-free speed guard).

    python benchmarks/calls_ab.py base=DIR mine=. --bytes 4096 --calls 2000

Times on a shared 2-core machine are bimodal and drift with the load; the number of Python
calls a rank makes per collective does not. For each tree this runs an in-process group
of 2 (one event loop: shared memory, and again over TCP with DSML_SHM=0) under cProfile
and prints the calls per all_reduce per rank, and the functions whose counts differ from
the first tree's. A benchmark: nothing here asserts anything.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import asyncio, cProfile, json, pstats, sys
import numpy as np
from dsml.testing import open_local_cluster
nbytes, calls = int(sys.argv[1]), int(sys.argv[2])
async def main():
    async with open_local_cluster(2) as cluster:
        async def loop(comm, n):
            x = np.ones(nbytes // 4, np.float32)
            for _ in range(n):
                await comm.all_reduce(x)
        await cluster.run(lambda comm: loop(comm, 100))
        profile = cProfile.Profile()
        profile.enable()
        await cluster.run(lambda comm: loop(comm, calls))
        profile.disable()
        stats = pstats.Stats(profile)
        per = {}
        for (path, line, name), (_, n, *_rest) in stats.stats.items():
            short = path.split("/dsml/")[-1] if "/dsml/" in path else path.rsplit("/", 1)[-1]
            key = f"{short}:{name}"
            per[key] = per.get(key, 0) + n / calls / 2
        print(json.dumps({"total": stats.total_calls / calls / 2, "per": per}))
asyncio.run(main())
"""


def count(tree: Path, args: argparse.Namespace, shm: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "DSML_SHM": "1" if shm else "0"}
    cmd = [sys.executable, "-c", CHILD, str(args.bytes), str(args.calls)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(prog="calls_ab")
    parser.add_argument("trees", nargs="+", help="label=path")
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--top", type=int, default=12, help="differing functions shown")
    args = parser.parse_args()
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) for t in args.trees]
    for shm in (True, False):
        print(f"# {'shared memory' if shm else 'TCP (DSML_SHM=0)'}, {args.bytes} B, world 2")
        results = {label: count(path, args, shm) for label, path in trees}
        first = results[trees[0][0]]
        for label, _ in trees:
            total = results[label]["total"]
            print(f"{label:>10}: {total:7.1f} Python calls per all_reduce per rank")
        for label, _ in trees[1:]:
            per, base = results[label]["per"], first["per"]
            diff = {k: per.get(k, 0) - base.get(k, 0) for k in set(per) | set(base)}
            for key, delta in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[: args.top]:
                if abs(delta) >= 0.5:
                    print(f"    {label} {delta:+5.1f}  {key}")


if __name__ == "__main__":
    main()
