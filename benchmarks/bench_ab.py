"""`dsml bench` of several source trees, interleaved (a benchmark).

    python benchmarks/bench_ab.py base=DIR mine=. -n 4 --sizes 4K,64K,1M --repeat 3

Runs `python -m dsml bench --json` with PYTHONPATH set to each tree in turn (A, B, A, B,
...), `--repeat` times, and prints per size the median over repeats of each tree's p50 and
its ratio to the first tree's (below 1: faster than the first). The environment passes
through (DSML_SHM=1 for shared memory). A benchmark: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def bench(tree: Path, args: argparse.Namespace) -> dict[int, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "dsml", "bench", "-n", str(args.n), "--sizes", args.sizes]
    cmd += ["--algorithm", args.algorithm, "--json", "--cpu-bind", args.cpu_bind]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=tree)
    rows = json.loads(out.stdout[out.stdout.index("[") :])
    return {row["bytes"]: row.get("p50_s", row.get("median_s")) for row in rows}


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench_ab")
    parser.add_argument("trees", nargs="+", help="label=path")
    parser.add_argument("-n", type=int, default=4)
    parser.add_argument("--sizes", default="4K,64K,1M")
    parser.add_argument("--algorithm", default="auto")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--cpu-bind",
        default="auto",
        help="dsml bench's --cpu-bind (spread: a core per rank, steadier with few cores)",
    )
    args = parser.parse_args()
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) for t in args.trees]
    runs: dict[str, list[dict[int, float]]] = {label: [] for label, _ in trees}
    for r in range(args.repeat):
        for label, path in trees:
            runs[label].append(bench(path, args))
            got = ", ".join(f"{b}: {t * 1e6:.0f} us" for b, t in runs[label][-1].items())
            print(f"# repeat {r + 1} {label}: {got}", file=sys.stderr, flush=True)
    first = trees[0][0]
    sizes = sorted(runs[first][0])
    print(f"{'bytes':>10} " + " ".join(f"{label:>18}" for label, _ in trees))
    for size in sizes:
        medians = {label: statistics.median(run[size] for run in runs[label]) for label in runs}
        cells = [
            f"{medians[label] * 1e6:9.1f}us x{medians[label] / medians[first]:5.2f}"
            for label, _ in trees
        ]
        print(f"{size:>10} " + " ".join(f"{c:>18}" for c in cells))


if __name__ == "__main__":
    main()
