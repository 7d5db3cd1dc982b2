"""What CURVE costs against the default (the job secret), interleaved (a benchmark).

    python benchmarks/bench_curve.py -n 2 --sizes 4K,1M,16M --repeat 5

Runs `dsml bench --json` over TCP (DSML_SHM=0: shared memory skips the sockets) with the
job secret (PLAIN with an HMAC, the default) and with CURVE keys made for the run,
alternately, and prints per size the median p50 of each with the ratio and the p10-p90
spread. On loopback encryption is the only difference; across hosts the link may hide
part of it. A benchmark: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def bench(args: argparse.Namespace, keys: str | None) -> dict[int, float]:
    env = {**os.environ, "DSML_SHM": "0"}
    cmd = [sys.executable, "-m", "dsml", "bench", "-n", str(args.n), "--sizes", args.sizes]
    cmd += ["--algorithm", args.algorithm, "--json"]
    if keys:
        cmd += ["--curve-keys", keys]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    rows = json.loads(out.stdout[out.stdout.index("[") :])
    return {row["bytes"]: row.get("p50_s", row.get("median_s")) for row in rows}


def _spread(values: list[float]) -> str:
    if len(values) < 3:
        return ""
    deciles = statistics.quantiles(values, n=10)
    return f" [{deciles[0] * 1e6:.0f}-{deciles[-1] * 1e6:.0f}]"


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench_curve")
    parser.add_argument("-n", type=int, default=2)
    parser.add_argument("--sizes", default="4K,64K,1M,16M")
    parser.add_argument("--algorithm", default="auto")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        keys = str(Path(tmp) / "keys")
        subprocess.run([sys.executable, "-m", "dsml", "keys", "generate", keys], check=True)
        runs: dict[str, list[dict[int, float]]] = {"secret": [], "curve": []}
        for r in range(args.repeat):
            order = ["secret", "curve"] if r % 2 == 0 else ["curve", "secret"]
            for label in order:
                runs[label].append(bench(args, keys if label == "curve" else None))
                print(f"# repeat {r + 1} {label} done", file=sys.stderr, flush=True)
    print(f"{'bytes':>10} {'secret p50 us':>22} {'CURVE p50 us':>22} {'CURVE/secret':>13}")
    for size in sorted(runs["secret"][0]):
        plain = [run[size] for run in runs["secret"]]
        curve = [run[size] for run in runs["curve"]]
        a, b = statistics.median(plain), statistics.median(curve)
        print(
            f"{size:>10} {a * 1e6:>10.0f}{_spread(plain):>12} {b * 1e6:>10.0f}"
            f"{_spread(curve):>12} {b / a:>12.2f}x"
        )


if __name__ == "__main__":
    main()
