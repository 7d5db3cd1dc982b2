"""DDP step time with backend "dsml" against "gloo", in the same run, alternating.

    dsml run -n 4 benchmarks/ddp_step.py                  # ~10M parameters, 4 ranks
    torchrun --nproc-per-node 4 benchmarks/ddp_step.py
    dsml run -n 4 benchmarks/ddp_step.py --width 512 --rounds 3 --steps 3   # a quick check

Every rank builds two identical models (an MLP of about 10M float32 parameters with the
default width), one wrapped in DDP over the default group (backend "dsml") and one over a
gloo group of the same ranks. Rounds alternate which backend goes first; each round times
`--steps` training steps (forward, backward with DDP's bucketed all_reduce, SGD step) per
backend after one untimed step. Rank 0 prints the median step time of each backend, its
spread (the interquartile range and min..max over all timed steps), and the ratio
dsml / gloo (below 1: dsml is faster), then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import dsml.torch  # noqa: F401 (registers the "dsml" backend)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--width", type=int, default=1664, help="hidden width (1664: ~10M)")
    parser.add_argument("--batch", type=int, default=32, help="rows per rank per step")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
    return parser.parse_args()


def mlp(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(1024, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )


def timed_steps(model: DDP, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    times = []
    for i in range(steps + 1):  # the first step is not timed
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if i:
            times.append(time.perf_counter() - start)
    return times


def summary(times: list[float]) -> dict[str, float]:
    q1, median, q3 = statistics.quantiles(times, n=4)
    return {"median_s": median, "q1_s": q1, "q3_s": q3, "min_s": min(times), "max_s": max(times)}


def main() -> None:
    args = parse_args()
    dist.init_process_group("dsml")
    rank, size = dist.get_rank(), dist.get_world_size()
    groups = {"dsml": None, "gloo": dist.new_group(list(range(size)), backend="gloo")}
    models = {
        name: DDP(mlp(args.width), process_group=group, bucket_cap_mb=args.bucket_mb)
        for name, group in groups.items()
    }
    params = sum(p.numel() for p in models["dsml"].parameters())
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 1024, generator=generator)
    y = torch.randint(0, 10, (args.batch,), generator=generator)
    times: dict[str, list[float]] = {name: [] for name in models}
    for round_ in range(args.rounds):
        order = ["dsml", "gloo"] if round_ % 2 == 0 else ["gloo", "dsml"]
        for name in order:
            times[name] += timed_steps(models[name], x, y, args.steps)
    if rank == 0:
        result = {name: summary(t) for name, t in times.items()}
        ratio = result["dsml"]["median_s"] / result["gloo"]["median_s"]
        print(f"DDP step, {params / 1e6:.1f}M float32 parameters, world {size}, batch {args.batch}")
        for name, s in result.items():
            print(
                f"  {name}: median {s['median_s'] * 1e3:7.1f} ms  IQR "
                f"{s['q1_s'] * 1e3:.1f}..{s['q3_s'] * 1e3:.1f}  range "
                f"{s['min_s'] * 1e3:.1f}..{s['max_s'] * 1e3:.1f} ms  ({len(times[name])} steps)"
            )
        print(f"  ratio dsml/gloo (median): {ratio:.3f}")
        print(json.dumps({"params": params, "world_size": size, "ratio": ratio, **result}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
