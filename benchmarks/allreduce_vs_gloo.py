"""dsml all_reduce against torch.distributed (Gloo), side by side in one run.

    python benchmarks/allreduce_vs_gloo.py -n 4 --sizes 4K,1M,16M,64M

Runs `dsml bench --json` (algorithm auto, plus --algorithms if given), then, when torch is
installed, the same sizes through torch.distributed with the Gloo backend, timed the same
way, and prints median time and bus bandwidth for both with their ratio. Benchmarks are not
tests: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path
from typing import Any

from common import bench_rows, dsml, tagged_lines

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gloo_rows(n: int, sizes: list[int]) -> list[dict[str, Any]]:
    try:
        import torch  # noqa: F401
    except ImportError:
        print("# torch is not installed: Gloo side skipped (pip install torch)", file=sys.stderr)
        return []
    port = str(free_port())
    out = dsml(
        "run",
        "-n",
        str(n),
        str(HERE / "gloo_worker.py"),
        ",".join(map(str, sizes)),
        port,
        env={"OMP_NUM_THREADS": "1"},
    )
    return [json.loads(line) for line in tagged_lines(out, "GLOO_ROW")]


def median_rows(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per (bytes, algorithm), the row of the run with the median time."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for run in runs:
        for row in run:
            groups.setdefault((row["bytes"], row["algorithm"]), []).append(row)
    return [sorted(rows, key=lambda r: r["median_s"])[len(rows) // 2] for rows in groups.values()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=4)
    parser.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    parser.add_argument("--algorithms", default="auto", help="dsml algorithms to include")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each side (median)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    runs_ours, runs_theirs = [], []
    for _ in range(args.repeat):  # interleaved, so a noisy minute hurts both sides
        runs_ours.append(bench_rows(args.n, args.sizes, args.algorithms))
        sizes = sorted({r["bytes"] for r in runs_ours[-1]})
        runs_theirs.append(gloo_rows(args.n, sizes))
    ours = median_rows(runs_ours)
    theirs = {r["bytes"]: r for r in median_rows(runs_theirs)}
    if args.json:
        print(json.dumps({"dsml": ours, "gloo": list(theirs.values())}, indent=2))
        return
    print(
        f"# world_size={args.n}, float32 sum, median of timed calls, median of {args.repeat} "
        "run(s); speedup = Gloo time / dsml time"
    )
    print(
        f"# {'bytes':>10} {'algorithm':>9} {'dsml us':>10} {'busbw':>7} "
        f"{'gloo us':>10} {'busbw':>7} {'speedup':>8}"
    )
    for r in ours:
        g = theirs.get(r["bytes"])
        gl = (
            f"{g['median_s'] * 1e6:>10.1f} {g['busbw_GBps']:>7.3f} "
            f"{g['median_s'] / r['median_s']:>7.2f}x"
            if g
            else f"{'-':>10} {'-':>7} {'-':>8}"
        )
        print(
            f"  {r['bytes']:>10} {r['algorithm']:>9} {r['median_s'] * 1e6:>10.1f} "
            f"{r['busbw_GBps']:>7.3f} {gl}"
        )


if __name__ == "__main__":
    main()
