"""Measure every all_reduce algorithm per size and world size: the data behind `auto`.

    python benchmarks/tune_auto.py --worlds 2,3,4 --sizes 4K,16K,64K,256K,1M,4M,16M,64M

Runs `dsml bench --algorithm ring,tree,naive,direct,mesh --json` `--repeat` times per
world size (repetitions interleaved with the other world sizes, so a noisy minute hurts
every candidate alike), and prints per size the median time of each algorithm, the
fastest, and what `auto` picks now (dsml/collectives/select.py). A benchmark: it asserts
nothing.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from common import bench_rows

from dsml.collectives import choose_all_reduce

ALGORITHMS = "ring,tree,naive,direct,mesh"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,3,4")
    parser.add_argument("--sizes", default="4K,16K,64K,256K,1M,4M,16M,64M")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    times: dict[tuple[int, int, str], list[float]] = defaultdict(list)
    for _ in range(args.repeat):
        for world in worlds:
            for row in bench_rows(world, args.sizes, ALGORITHMS):
                times[(world, row["bytes"], row["algorithm"])].append(row["median_s"])
    names = ALGORITHMS.split(",")
    print(f"# median of {args.repeat} runs, microseconds; best marked *, auto's pick in []")
    for world in worlds:
        print(f"# world_size={world}\n# {'bytes':>10} " + " ".join(f"{n:>10}" for n in names))
        for nbytes in sorted({k[1] for k in times if k[0] == world}):
            medians = {n: statistics.median(times[(world, nbytes, n)]) for n in names}
            best = min(medians, key=medians.__getitem__)
            auto = choose_all_reduce(nbytes, world)
            cells = []
            for n in names:
                mark = ("*" if n == best else " ") + ("[]" if n == auto else "  ")
                cells.append(f"{medians[n] * 1e6:>7.0f}{mark}")
            print(f"  {nbytes:>10} " + " ".join(cells))


if __name__ == "__main__":
    main()
