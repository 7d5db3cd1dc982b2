"""A rank of a BSP parameter-server job in which one worker is killed mid-run (fault tests).

    DSML_REGISTRY=... DSML_WORLD_SIZE=4 DSML_RANK=R python tests/scripts/ps_bsp_replay.py

Ranks 0-2 are workers, the last `--servers` ranks servers (BSP, SGD(0.5), float64
softmax regression on seeded data, so a run can be replayed exactly; `--replicas 1` keeps
a backup of each shard). Worker `--victim` pushes its gradient of step `--stop-at`, waits
until the server has taken it, prints `stopped` and waits for a line on its stdin (in a
thread: its event loop, heartbeats included, goes on); the test then SIGKILLs it, or
SIGKILLs a server and writes the line so that the victim goes on. The others train all
`--steps` steps.

Events (one JSON object per line, flushed):
  step     {worker, step}                  (every 10 steps)
  stopped  {worker, step}                  the victim, waiting for its stdin
  final    {worker, params}                worker 0's final parameters (float64 lists)
  server   {index, updates, contributors, lost, replica}   a server's stats after serving
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import numpy as np

import dsml
import dsml.ps

FEATURES, CLASSES, LR = 12, 5, 0.5


def say(**event: object) -> None:
    print(json.dumps(event), flush=True)


def data(seed: int, n: int = 240) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, FEATURES))
    return x, (x @ rng.standard_normal((FEATURES, CLASSES))).argmax(axis=1)


def initial(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + 1)
    return {"w": rng.standard_normal((FEATURES, CLASSES)) * 0.1, "b": np.zeros(CLASSES)}


def gradient(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, normalizer: int):
    """Gradient of sum(cross-entropy over x) / normalizer (as tests/test_ps.py)."""
    logits = x @ params["w"] + params["b"]
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    p /= normalizer
    return {"w": x.T @ p, "b": p.sum(axis=0)}


def part(step: int, worker: int, workers: int, n: int, batch: int = 30) -> np.ndarray:
    """Worker's part of global batch `step` (the same split whoever is still alive)."""
    indices = np.arange(step * batch, (step + 1) * batch) % n
    return np.array_split(indices, workers)[worker]


async def work(node: dsml.ps.ParameterServers, args: argparse.Namespace) -> None:
    x, y = data(args.seed)
    params = {k: np.zeros(s.shape) for k, s in node.layout.keys.items()}
    await asyncio.gather(*(node.pull(k, v) for k, v in params.items()))
    for step in range(args.steps):
        mine = part(step, node.index, node.num_workers, len(y))
        pushes = [node.push(k, g) for k, g in gradient(params, x[mine], y[mine], 30).items()]
        if node.index == args.victim and step == args.stop_at:
            await asyncio.gather(*pushes)  # the server has this step's gradient
            say(event="stopped", worker=node.index, step=step)
            await asyncio.to_thread(sys.stdin.readline)  # the test acts, then lets it go on
        await asyncio.gather(*(node.pull(k, v) for k, v in params.items()))
        if step % 10 == 0:
            say(event="step", worker=node.index, step=step)
    await node.finish()
    if node.index == 0:
        say(event="final", worker=0, params={k: v.tolist() for k, v in params.items()})


async def main(args: argparse.Namespace) -> None:
    config = dsml.ps.PSConfig(
        servers=args.servers, consistency="bsp", optimizer=dsml.ps.SGD(LR), replicas=args.replicas
    )
    async with dsml.init() as comm, dsml.ps.open_ps(comm, initial(args.seed), config) as node:
        if node.is_server:
            await node.serve()
            stats = node.stats()
            say(event="server", index=node.index, **stats)
        else:
            await work(node, args)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--stop-at", type=int, default=20)
    parser.add_argument("--victim", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--replicas", type=int, default=0)
    asyncio.run(main(parser.parse_args()))
