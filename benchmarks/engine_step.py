"""Data-parallel training step: engine-scheduled against sequential (a benchmark).

    python benchmarks/engine_step.py            # runs 2 and 4 workers, prints a table
    dsml run -n 4 benchmarks/engine_step.py --worker
    sudo python benchmarks/engine_step.py --hosts 4 --rate 1gbit --batch 1024
                                                # 4 namespaced hosts on 1 Gbit links

An MLP's backward pass in numpy, layer by layer (last layer first). The sequential step
computes every gradient, then all-reduces them one after another. The engine step pushes
each layer's backward computation into `comm.engine` (numpy runs on the engine's thread
pool) and pushes the layer's gradient all_reduce (`comm.push_all_reduce`) as soon as that
gradient exists, so communication of layer L overlaps the computation of layer L-1.
Both compute the same numbers (checked). With `--hosts`, one rank runs on each of that
many network-namespace hosts (dsml.testing.netns, links shaped with tbf to `--rate`): there
the link, not the CPU, is the bottleneck, so compute can hide behind communication (pick
`--batch` so that the backward pass takes about as long as the gradients' all_reduce).
The two variants alternate step by step; the
reported time of a step is the slowest rank's; the median over steps is printed.
Benchmarks are not tests: nothing is asserted about time.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from typing import Any

import numpy as np
from common import dsml, tagged_lines

WIDTHS = [784, 512, 512, 512, 512, 10]
BATCH = 64


class MLP:
    """ReLU layers, a linear output and a mean squared error loss (enough for a backward)."""

    def __init__(self, seed: int, widths: list[int]) -> None:
        rng = np.random.default_rng(seed)
        self.weights = [
            (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
            for a, b in itertools.pairwise(widths)
        ]

    def forward(self, x: np.ndarray) -> list[np.ndarray]:
        acts = [x]
        for i, w in enumerate(self.weights):
            z = acts[-1] @ w
            acts.append(np.maximum(z, 0) if i < len(self.weights) - 1 else z)
        return acts

    def output_delta(self, acts: list[np.ndarray], target: np.ndarray) -> np.ndarray:
        return (2 / len(target) * (acts[-1] - target)).astype(np.float32)

    def layer_backward(
        self, i: int, acts: list[np.ndarray], delta: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Gradient of layer i's weights, and the delta for layer i-1 (None for i == 0)."""
        grad = acts[i].T @ delta
        if i == 0:
            return grad, None
        back = delta @ self.weights[i].T
        back *= acts[i] > 0
        return grad, back


async def sequential_step(comm: Any, net: MLP, x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    acts = net.forward(x)
    delta: np.ndarray | None = net.output_delta(acts, y)
    grads: list[np.ndarray] = [np.empty(0)] * len(net.weights)
    for i in reversed(range(len(net.weights))):
        assert delta is not None
        grads[i], delta = net.layer_backward(i, acts, delta)
    for grad in reversed(grads):
        await comm.all_reduce(grad, "avg")
    return grads


async def engine_step(comm: Any, net: MLP, x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    engine = comm.engine
    acts = net.forward(x)
    n = len(net.weights)
    deltas = [engine.tag(f"delta{i}", None) for i in range(n + 1)]
    grads = [engine.tag(f"grad{i}", None) for i in range(n)]
    deltas[n].data = net.output_delta(acts, y)

    def backward(i: int) -> Any:
        def run() -> None:
            grads[i].data, deltas[i].data = net.layer_backward(i, acts, deltas[i + 1].data)

        return run

    for i in reversed(range(n)):  # the last layer's gradient exists first
        engine.push(
            backward(i),
            read=[deltas[i + 1].var],
            mutate=[grads[i].var, deltas[i].var],
            name=f"backward{i}",
        )
        # One all_reduce on the wire at a time (each waits for the one before to finish):
        # collectives in flight together share the links and delay each other's steps.
        after = [grads[i + 1].var] if i + 1 < n else []
        comm.push_all_reduce(grads[i], "avg", read=after)
    await engine.wait_all()
    return [g.data for g in grads]


async def timed(comm: Any, net: MLP, x: np.ndarray, y: np.ndarray, steps: int) -> dict[str, float]:
    """Median step time of each variant; the variants alternate, so noise hits both."""
    variants = {"sequential": sequential_step, "engine": engine_step}
    times = np.empty((len(variants), steps))
    for k in range(steps):
        for v, step in enumerate(variants.values()):
            await comm.barrier()
            start = time.perf_counter()
            await step(comm, net, x, y)
            times[v, k] = time.perf_counter() - start
    await comm.all_reduce(times, "max")
    return {name: float(np.median(times[v])) for v, name in enumerate(variants)}


async def worker(steps: int, widths: list[int], batch: int) -> None:
    import dsml

    async with dsml.init() as comm:
        net = MLP(0, widths)
        rng = np.random.default_rng(1 + comm.rank)
        x = rng.standard_normal((batch, widths[0])).astype(np.float32)
        y = rng.standard_normal((batch, widths[-1])).astype(np.float32)
        a = await sequential_step(comm, net, x, y)
        b = await engine_step(comm, net, x, y)
        same = all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))
        await timed(comm, net, x, y, 2)  # warm up
        results = await timed(comm, net, x, y, steps)
        if comm.rank == 0:
            grad_bytes = sum(w.nbytes for w in net.weights)
            print(
                "ENGINE_STEP "
                + json.dumps(
                    {
                        "world_size": comm.world_size,
                        "same_gradients": same,
                        "gradient_bytes": grad_bytes,
                        **results,
                        "speedup": results["sequential"] / results["engine"],
                    }
                ),
                flush=True,
            )


def on_hosts(args: argparse.Namespace) -> None:
    """One rank per namespaced host (see benchmarks/multihost.py), one table row."""
    import sys

    from multihost import dsml_group

    from dsml.testing.netns import netns_hosts

    argv = [sys.executable, __file__, "--worker", "--steps", str(args.steps)]
    argv += ["--widths", args.widths, "--batch", str(args.batch)]
    with netns_hosts(args.hosts, rate=args.rate) as hosts:
        row = json.loads(tagged_lines(dsml_group(hosts, argv), "ENGINE_STEP")[0])
    print(
        f"# MLP {args.widths}, batch {args.batch} per rank, float32, {args.hosts} hosts at "
        f"{args.rate}; median step (slowest rank)"
    )
    print(f"# {'hosts':>7} {'sequential ms':>14} {'engine ms':>10} {'speedup':>8}  same grads")
    print(
        f"  {args.hosts:>7} {row['sequential'] * 1e3:>14.1f} {row['engine'] * 1e3:>10.1f} "
        f"{row['speedup']:>7.2f}x  {row['same_gradients']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help="run as one rank (under dsml run)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sizes", default="2,4", help="world sizes to run")
    parser.add_argument("--widths", default=",".join(map(str, WIDTHS)), help="layer widths")
    parser.add_argument("--batch", type=int, default=BATCH, help="samples per rank")
    parser.add_argument("--hosts", type=int, default=0, help="run on this many netns hosts")
    parser.add_argument("--rate", default="1gbit", help="with --hosts: link rate")
    args = parser.parse_args()
    widths = [int(v) for v in args.widths.split(",")]
    if args.worker:
        asyncio.run(worker(args.steps, widths, args.batch))
        return
    if args.hosts:
        on_hosts(args)
        return
    print(f"# MLP {widths}, batch {args.batch} per rank, float32; median step (slowest rank)")
    print(f"# {'workers':>7} {'sequential ms':>14} {'engine ms':>10} {'speedup':>8}  same grads")
    for n in (int(v) for v in args.sizes.split(",")):
        out = dsml(
            "run",
            "-n",
            str(n),
            __file__,
            "--worker",
            "--steps",
            str(args.steps),
            "--widths",
            args.widths,
            "--batch",
            str(args.batch),
        )
        row = json.loads(tagged_lines(out, "ENGINE_STEP")[0])
        print(
            f"  {n:>7} {row['sequential'] * 1e3:>14.1f} {row['engine'] * 1e3:>10.1f} "
            f"{row['speedup']:>7.2f}x  {row['same_gradients']}"
        )


if __name__ == "__main__":
    main()
