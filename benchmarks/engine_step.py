"""Data-parallel training step: engine-scheduled against sequential (a benchmark).

    python benchmarks/engine_step.py            # runs 2 and 4 workers, prints a table
    dsml run -n 4 benchmarks/engine_step.py --worker
    sudo python benchmarks/engine_step.py --hosts 4 --rate 1gbit --batch 512 --repeat 3
                                                # 4 namespaced hosts on 1 Gbit links
    sudo python benchmarks/engine_step.py --hosts 4 --rate 1gbit --batch 512 --compute device

An MLP's backward pass in numpy, layer by layer (last layer first). The sequential step
computes every gradient, then all-reduces them one after another, a call per layer. The
engine step pushes the backward computation into `comm.engine` (numpy runs on the
engine's thread pool): each layer's weight gradient in row blocks of about `--bucket-kib`
(512 KiB; 0: whole layers), then the delta for the layer below; and it pushes each block's
all_reduce (`comm.push_all_reduce`) as soon as the block exists, so communication
overlaps the computation that follows, and what is left after the last kernel is one
block's all_reduce, not the whole first layer's (DDP's gradient buckets do the same).
The `layers` column times the engine step with a block per layer, in the same run.
Both compute the same numbers up to float32 rounding (checked: `same grads`). With
`--hosts`, one rank runs on each of that many network-namespace hosts
(dsml.testing.netns, links shaped with tbf to `--rate`), `--repeat` groups one after
another, one row each.

Two more variants time the parts alone: `compute` (forward and backward, no
communication) and `comm` (the all_reduces alone). All four alternate step by step; a
step's time is the slowest rank's, and the median over steps is printed. `cpu ms` is the
CPU time of `compute` plus `comm`, summed over the ranks' processes. `ceiling` is the best
speedup any overlap could give here: the engine step cannot be shorter than `comm`, nor
than that CPU time spread over the machine's CPUs (the namespaced hosts share them; kernel
network work outside the processes is not counted, so the real ceiling is lower still).

`--compute device` stands for a step whose computation runs on an accelerator, where the
host's CPU only waits for the kernels: each rank first measures its numpy forward and
per-layer backward (median of 5, the slowest rank's taken by all), then every step waits
that long per layer (`time.sleep`, no CPU used) and returns the gradients computed once
up front; the numbers are the same as with `--compute numpy`. On the namespaced hosts,
which share this machine's few CPUs, numpy compute leaves no idle CPU for communication
to use, so it measures the engine's scheduling but cannot show overlap; `device` shows
how much of the communication the engine hides when the CPU is free during compute.
Benchmarks are not tests: nothing is asserted about time.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import os
import time
from typing import Any

import numpy as np
from common import dsml, tagged_lines

WIDTHS = [784, 512, 512, 512, 512, 10]
BATCH = 64
BUCKET_KIB = 512


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
        grad = np.empty_like(self.weights[i])
        self.weight_grad(i, acts, delta, grad, 0, len(grad))
        return grad, (self.delta_back(i, acts, delta) if i else None)

    def weight_grad(
        self, i: int, acts: list[np.ndarray], delta: np.ndarray, out: np.ndarray, r0: int, r1: int
    ) -> None:
        """Rows r0:r1 of layer i's weight gradient, written into out[r0:r1]."""
        np.matmul(acts[i][:, r0:r1].T, delta, out=out[r0:r1])

    def delta_back(self, i: int, acts: list[np.ndarray], delta: np.ndarray) -> np.ndarray:
        """The delta for layer i-1, from layer i's."""
        back = delta @ self.weights[i].T
        back *= acts[i] > 0
        return back


class DeviceMLP(MLP):
    """The same net and numbers, its computation standing for kernels on an accelerator:
    each call waits the measured time of the numpy computation without using the CPU, then
    returns (copies of) results computed once up front for this rank's batch."""

    def __init__(self, net: MLP, x: np.ndarray, y: np.ndarray, times: np.ndarray) -> None:
        self.weights = net.weights
        self._acts = net.forward(x)
        self._delta = net.output_delta(self._acts, y)
        self._backward: list[tuple[np.ndarray, np.ndarray | None]] = []
        delta: np.ndarray | None = self._delta
        for i in reversed(range(len(net.weights))):
            assert delta is not None
            grad, back = net.layer_backward(i, self._acts, delta)
            self._backward.append((grad, back))
            delta = back
        self._backward.reverse()
        n = len(net.weights)
        self._forward_s = float(times[0])
        self._grad_s = [float(t) for t in times[1 : n + 1]]
        self._back_s = [float(t) for t in times[n + 1 :]]

    def forward(self, x: np.ndarray) -> list[np.ndarray]:
        time.sleep(self._forward_s)
        return self._acts

    def output_delta(self, acts: list[np.ndarray], target: np.ndarray) -> np.ndarray:
        return self._delta

    def layer_backward(
        self, i: int, acts: list[np.ndarray], delta: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None]:
        time.sleep(self._grad_s[i] + self._back_s[i])
        grad, back = self._backward[i]
        return grad.copy(), back

    def weight_grad(
        self, i: int, acts: list[np.ndarray], delta: np.ndarray, out: np.ndarray, r0: int, r1: int
    ) -> None:
        time.sleep(self._grad_s[i] * (r1 - r0) / len(out))  # a kernel for these rows only
        out[r0:r1] = self._backward[i][0][r0:r1]

    def delta_back(self, i: int, acts: list[np.ndarray], delta: np.ndarray) -> np.ndarray:
        time.sleep(self._back_s[i])
        back = self._backward[i][1]
        assert back is not None
        return back


def compute_times(net: MLP, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """[forward, weight gradient of layer 0, 1, ..., delta back of layer 0, 1, ...] in
    seconds on this rank (layer 0 has no delta back: 0): median of 5."""
    samples = []
    n = len(net.weights)
    for _ in range(5):
        start = time.perf_counter()
        acts = net.forward(x)
        row = [time.perf_counter() - start] + [0.0] * (2 * n)
        delta = net.output_delta(acts, y)
        for i in reversed(range(n)):
            grad = np.empty_like(net.weights[i])
            start = time.perf_counter()
            net.weight_grad(i, acts, delta, grad, 0, len(grad))
            row[1 + i] = time.perf_counter() - start
            if i:
                start = time.perf_counter()
                delta = net.delta_back(i, acts, delta)
                row[1 + n + i] = time.perf_counter() - start
        samples.append(row)
    return np.median(np.array(samples), axis=0)


def row_blocks(weight: np.ndarray, bucket_bytes: int) -> list[tuple[int, int]]:
    """Row ranges of a weight gradient, about `bucket_bytes` each (0: the whole gradient)."""
    rows = len(weight)
    count = 1 if bucket_bytes <= 0 else max(1, min(rows, round(weight.nbytes / bucket_bytes)))
    edges = [rows * k // count for k in range(count + 1)]
    return list(itertools.pairwise(edges))


async def sequential_step(comm: Any, net: MLP, x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    grads = await compute_only(comm, net, x, y)
    for grad in reversed(grads):
        await comm.all_reduce(grad, "avg")
    return grads


async def engine_step(
    comm: Any, net: MLP, x: np.ndarray, y: np.ndarray, bucket_bytes: int = 0
) -> list[np.ndarray]:
    """The step through the engine. Each layer's weight gradient is computed in row blocks
    of about `bucket_bytes` (0: whole layers), and each block's all_reduce is pushed as
    soon as the block exists, as DDP does with its buckets; so the communication left
    after the last computation is one block's, not the whole first layer's. Every
    computation mutates one `device` var: they run one after another, as kernels on one
    stream would, never side by side on the pool."""
    engine = comm.engine
    acts = net.forward(x)
    n = len(net.weights)
    device = engine.new_var("device")
    deltas = [engine.tag(f"delta{i}", None) for i in range(n + 1)]
    deltas[n].data = net.output_delta(acts, y)
    grads = [np.empty_like(w) for w in net.weights]
    wire: Any = None  # the previous block's tag: one all_reduce on the wire at a time

    def weight_grad(i: int, r0: int, r1: int) -> Any:
        return lambda: net.weight_grad(i, acts, deltas[i + 1].data, grads[i], r0, r1)

    def delta_back(i: int) -> Any:
        def run() -> None:
            deltas[i].data = net.delta_back(i, acts, deltas[i + 1].data)

        return run

    for i in reversed(range(n)):  # the last layer's gradient exists first
        for r0, r1 in row_blocks(grads[i], bucket_bytes):
            block = engine.tag(f"grad{i}[{r0}:{r1}]", grads[i][r0:r1])
            engine.push(
                weight_grad(i, r0, r1),
                read=[deltas[i + 1].var],
                mutate=[device, block.var],
                name=f"grad{i}[{r0}:{r1}]",
            )
            # Collectives in flight together share the links and delay each other's steps.
            comm.push_all_reduce(block, "avg", read=[wire.var] if wire is not None else [])
            wire = block
        if i:
            engine.push(delta_back(i), read=[deltas[i + 1].var], mutate=[device, deltas[i].var])
    await engine.wait_all()
    return grads


async def compute_only(comm: Any, net: MLP, x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """The step's computation alone: forward and backward, no communication."""
    acts = net.forward(x)
    delta: np.ndarray | None = net.output_delta(acts, y)
    grads: list[np.ndarray] = [np.empty(0)] * len(net.weights)
    for i in reversed(range(len(net.weights))):
        assert delta is not None
        grads[i], delta = net.layer_backward(i, acts, delta)
    return grads


async def communicate_only(comm: Any, net: MLP, x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """The step's all_reduces alone, on arrays shaped like the gradients."""
    grads = [np.ones_like(w) for w in net.weights]
    for grad in reversed(grads):
        await comm.all_reduce(grad, "avg")
    return grads


def variants(bucket_bytes: int) -> dict[str, Any]:
    """The timed steps: `engine` with gradient blocks of `bucket_bytes`, `engine_layers`
    with a block per layer (the same as `engine` when `bucket_bytes` is 0)."""
    return {
        "sequential": sequential_step,
        "engine": functools.partial(engine_step, bucket_bytes=bucket_bytes),
        "engine_layers": engine_step,
        "compute": compute_only,
        "communicate": communicate_only,
    }


async def timed(
    comm: Any, net: MLP, x: np.ndarray, y: np.ndarray, steps: int, bucket_bytes: int
) -> dict[str, float]:
    """Per variant, the median step time (slowest rank) and CPU seconds (all ranks' processes
    together); the variants alternate step by step, so noise hits them all alike."""
    steps_by_name = variants(bucket_bytes)
    times = np.empty((len(steps_by_name), steps))
    cpu = np.empty((len(steps_by_name), steps))
    for k in range(steps):
        for v, step in enumerate(steps_by_name.values()):
            await comm.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            await step(comm, net, x, y)
            times[v, k] = time.perf_counter() - start
            cpu[v, k] = time.process_time() - start_cpu
    await comm.all_reduce(times, "max")
    await comm.all_reduce(cpu, "sum")
    medians = {name: float(np.median(times[v])) for v, name in enumerate(steps_by_name)}
    cpu_medians = {f"{name}_cpu": float(np.median(cpu[v])) for v, name in enumerate(steps_by_name)}
    return medians | cpu_medians


def ceiling(row: dict[str, Any], cores: int) -> float:
    """The best speedup overlap could give when every rank shares `cores` CPUs: the engine
    step takes at least as long as the communication alone, and at least as long as the
    CPU time of computing and communicating spread over the cores (a lower bound: kernel
    network work done outside the ranks' processes is not counted)."""
    busy = (row["compute_cpu"] + row["communicate_cpu"]) / cores
    return float(row["sequential"] / max(row["communicate"], busy))


async def worker(
    steps: int, widths: list[int], batch: int, compute: str, bucket_bytes: int
) -> None:
    import dsml

    async with dsml.init() as comm:
        net = MLP(0, widths)
        rng = np.random.default_rng(1 + comm.rank)
        x = rng.standard_normal((batch, widths[0])).astype(np.float32)
        y = rng.standard_normal((batch, widths[-1])).astype(np.float32)
        if compute == "device":
            times = compute_times(net, x, y)
            await comm.all_reduce(times, "max")  # every rank waits as long as the slowest
            net = DeviceMLP(net, x, y, times)
        a = await sequential_step(comm, net, x, y)
        b = await engine_step(comm, net, x, y, bucket_bytes)
        # Equal up to float32 rounding: a block's all_reduce may sum its elements in another
        # rank order (or by another algorithm) than the whole layer's does.
        same = all(np.allclose(p, q, rtol=1e-5, atol=1e-7) for p, q in zip(a, b, strict=True))
        await timed(comm, net, x, y, 2, bucket_bytes)  # warm up
        results = await timed(comm, net, x, y, steps, bucket_bytes)
        if comm.rank == 0:
            grad_bytes = sum(w.nbytes for w in net.weights)
            print(
                "ENGINE_STEP "
                + json.dumps(
                    {
                        "world_size": comm.world_size,
                        "compute": compute,
                        "same_gradients": same,
                        "gradient_bytes": grad_bytes,
                        **results,
                        "bucket_bytes": bucket_bytes,
                        "speedup": results["sequential"] / results["engine"],
                        "speedup_layers": results["sequential"] / results["engine_layers"],
                    }
                ),
                flush=True,
            )


HEADER = (
    f"# {'ranks':>5} {'sequential ms':>13} {'engine ms':>9} {'speedup':>7} {'layers':>7} "
    f"{'compute ms':>10} {'comm ms':>7} {'cpu ms':>7} {'ceiling':>7}  same grads"
)


def row_line(ranks: int, row: dict[str, Any], cores: int) -> str:
    """One table row; `cpu ms`: CPU time of computing plus communicating (all ranks)."""
    cpu = row["compute_cpu"] + row["communicate_cpu"]
    return (
        f"  {ranks:>5} {row['sequential'] * 1e3:>13.1f} {row['engine'] * 1e3:>9.1f} "
        f"{row['speedup']:>6.2f}x {row['speedup_layers']:>6.2f}x "
        f"{row['compute'] * 1e3:>10.1f} {row['communicate'] * 1e3:>7.1f} "
        f"{cpu * 1e3:>7.1f} {ceiling(row, cores):>6.2f}x  {row['same_gradients']}"
    )


def on_hosts(args: argparse.Namespace) -> None:
    """One rank per namespaced host (see benchmarks/multihost.py), a row per repeat."""
    import statistics
    import sys

    from multihost import dsml_group

    from dsml.testing.netns import netns_hosts

    argv = [sys.executable, __file__, "--worker", "--steps", str(args.steps)]
    argv += ["--widths", args.widths, "--batch", str(args.batch), "--compute", args.compute]
    argv += ["--bucket-kib", str(args.bucket_kib)]
    cores = os.cpu_count() or 1
    print(
        f"# MLP {args.widths}, batch {args.batch} per rank, float32, {args.compute} compute, "
        f"gradient blocks of {args.bucket_kib} KiB, "
        f"{args.hosts} hosts at {args.rate} sharing {cores} CPUs; median step (slowest rank) "
        f"of {args.steps}"
    )
    print(HEADER)
    speedups = []
    with netns_hosts(args.hosts, rate=args.rate) as hosts:
        for _ in range(args.repeat):
            row = json.loads(tagged_lines(dsml_group(hosts, argv), "ENGINE_STEP")[0])
            speedups.append(row["speedup"])
            print(row_line(args.hosts, row, cores), flush=True)
    print(
        f"# speedup: median {statistics.median(speedups):.2f}x over {len(speedups)} runs "
        f"(spread {min(speedups):.2f}x-{max(speedups):.2f}x)"
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
    parser.add_argument("--repeat", type=int, default=3, help="with --hosts: runs of the group")
    parser.add_argument(
        "--bucket-kib",
        type=int,
        default=BUCKET_KIB,
        help="engine step: gradient blocks of about this size, each all-reduced once computed "
        "(0: one per layer; the `layers` column always times one per layer)",
    )
    parser.add_argument(
        "--compute",
        choices=("numpy", "device"),
        default="numpy",
        help="numpy on the CPU, or device: wait as long without using the CPU (see above)",
    )
    args = parser.parse_args()
    widths = [int(v) for v in args.widths.split(",")]
    if args.worker:
        asyncio.run(worker(args.steps, widths, args.batch, args.compute, args.bucket_kib * 1024))
        return
    if args.hosts:
        on_hosts(args)
        return
    cores = os.cpu_count() or 1
    print(
        f"# MLP {widths}, batch {args.batch} per rank, float32, {args.compute} compute; "
        "median step (slowest rank)"
    )
    print(HEADER)
    for n in (int(v) for v in args.sizes.split(",")):
        argv = ["run", "-n", str(n), __file__, "--worker", "--steps", str(args.steps)]
        out = dsml(
            *argv,
            *("--widths", args.widths, "--batch", str(args.batch), "--compute", args.compute),
            *("--bucket-kib", str(args.bucket_kib)),
        )
        row = json.loads(tagged_lines(out, "ENGINE_STEP")[0])
        print(row_line(n, row, cores), flush=True)


if __name__ == "__main__":
    main()
