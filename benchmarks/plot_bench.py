"""All-reduce bus bandwidth of every algorithm, with error bars, for the docs site.

Runs `dsml bench -n N --algorithm all --json` REPEAT times (each run measures every
algorithm at every size, interleaved), then draws one line per algorithm: the median over
runs of each run's median time, as bus bandwidth, with bars from the median 10th to the
median 90th percentile. Writes the figure (PNG) and the raw rows (JSON).

    python benchmarks/plot_bench.py -n 4 --repeat 5 --out docs/img/bench_allreduce
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import defaultdict
from typing import Any

import numpy as np
from common import bench_rows, dsml_version


def summarise(runs: list[list[dict[str, Any]]]) -> dict[str, dict[int, dict[str, float]]]:
    """algorithm -> bytes -> median over runs of p10_s, p50_s, p90_s, busbw at p50."""
    by: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for rows in runs:
        for row in rows:
            by[row["algorithm"], row["bytes"]].append(row)
    out: dict[str, dict[int, dict[str, float]]] = defaultdict(dict)
    for (algorithm, nbytes), rows in sorted(by.items()):
        stats = {k: float(np.median([r[k] for r in rows])) for k in ("p10_s", "p50_s", "p90_s")}
        scale = rows[0]["busbw_GBps"] * rows[0]["p50_s"]  # busbw = scale / time
        stats.update({f"busbw_{k[:3]}": scale / stats[k] for k in ("p10_s", "p50_s", "p90_s")})
        stats["chosen"] = rows[0].get("chosen", algorithm)  # type: ignore[assignment]
        out[algorithm][nbytes] = stats
    return out


def plot(summary: dict[str, dict[int, dict[str, float]]], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for algorithm, sizes in summary.items():
        x = sorted(sizes)
        mid = np.array([sizes[s]["busbw_p50"] for s in x])
        low = mid - np.array([sizes[s]["busbw_p90"] for s in x])  # slower calls: lower bw
        high = np.array([sizes[s]["busbw_p10"] for s in x]) - mid
        style = {"linewidth": 2.5, "color": "black"} if algorithm == "auto" else {}
        ax.errorbar(x, mid, yerr=[low, high], marker="o", capsize=3, label=algorithm, **style)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("array size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s), median; bars: p10-p90")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=4, help="ranks (default: 4)")
    parser.add_argument("--sizes", default="4K,64K,1M,16M")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default="bench_allreduce", help="path without extension")
    args = parser.parse_args()
    runs = []
    for i in range(args.repeat):
        runs.append(bench_rows(args.n, args.sizes, "all"))
        print(f"run {i + 1}/{args.repeat} done", flush=True)
    summary = summarise(runs)
    load = os.getloadavg()[0]
    title = (
        f"all_reduce, {args.n} ranks on {os.cpu_count()} cores ({platform.machine()}), "
        f"{args.repeat} runs, load {load:.1f}"
    )
    plot(summary, title, args.out + ".png")
    made = {
        "title": title,
        # what made it, for tests/test_figures.py and for whoever regenerates it
        "command": " ".join(["python", "benchmarks/plot_bench.py", *sys.argv[1:]]),
        "dsml": dsml_version(),
        "date": time.strftime("%Y-%m-%d"),
        "runs": runs,
    }
    with open(args.out + ".json", "w") as f:
        json.dump(made, f, indent=1)
    for algorithm, sizes in summary.items():
        cells = ", ".join(f"{s}: {v['p50_s'] * 1e6:.0f} us" for s, v in sizes.items())
        print(f"{algorithm:>7}: {cells}")


if __name__ == "__main__":
    main()
