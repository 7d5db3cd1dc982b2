"""Parameter servers (dsml.ps): sharding, optimizers, the server's rules, and real groups.

In-process groups run over real ZeroMQ sockets (`open_local_cluster`); the MNIST example
runs as real processes under `dsml run`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

import dsml.ps as ps
from dsml.testing import open_local_cluster

ROOT = Path(__file__).resolve().parent.parent

# -- a small model: softmax regression in float64, so sums in any order agree to 1e-15 ------

FEATURES, CLASSES = 12, 5


def make_data(seed: int, n: int = 240) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, FEATURES))
    truth = rng.standard_normal((FEATURES, CLASSES))
    return x, (x @ truth).argmax(axis=1)


def initial_params(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + 1)
    return {"w": rng.standard_normal((FEATURES, CLASSES)) * 0.1, "b": np.zeros(CLASSES)}


def gradient(
    params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, normalizer: int
) -> dict[str, np.ndarray]:
    """Gradient of sum(cross-entropy over x) / normalizer."""
    logits = x @ params["w"] + params["b"]
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    p /= normalizer
    return {"w": x.T @ p, "b": p.sum(axis=0)}


def batches(n: int, size: int, steps: int) -> list[np.ndarray]:
    return [np.arange(i * size, (i + 1) * size) % n for i in range(steps)]


async def train_worker(
    node: ps.ParameterServers, x: np.ndarray, y: np.ndarray, steps: list[np.ndarray]
) -> dict[str, np.ndarray]:
    """One worker's loop: pull, gradient on its part of the global batch, push."""
    params = {k: np.zeros(s.shape) for k, s in node.layout.keys.items()}
    await asyncio.gather(*(node.pull(k, v) for k, v in params.items()))
    for batch in steps:
        mine = np.array_split(batch, node.num_workers)[node.index]
        for key, g in gradient(params, x[mine], y[mine], len(batch)).items():
            node.push(key, g)
        await asyncio.gather(*(node.pull(k, v) for k, v in params.items()))
    final = {k: np.zeros_like(v) for k, v in params.items()}
    await node.finish(pull=final)
    return final


async def run_group(
    size: int, config: ps.PSConfig, seed: int, steps: int = 12, batch: int = 30
) -> list[dict[str, np.ndarray] | dict[str, object]]:
    x, y = make_data(seed)
    plan = batches(len(y), batch, steps)

    async def rank(comm):
        async with ps.open_ps(comm, initial_params(seed), config) as node:
            if node.is_server:
                await node.serve()
                return node.stats()
            return await train_worker(node, x, y, plan)

    async with open_local_cluster(size) as cluster:
        return await cluster.run(rank)


# -- BSP equals one large-batch step ------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("size", "servers"), [(2, 1), (4, 2), (5, 1)])
async def test_bsp_takes_the_same_steps_as_one_process_on_the_whole_batch(size, servers, seed):
    config = ps.PSConfig(
        servers=servers, consistency="bsp", optimizer=ps.SGD(0.5), max_piece_bytes=64
    )  # small pieces: every key is split
    results = await run_group(size, config, seed)
    workers = results[: size - servers]
    x, y = make_data(seed)
    large_batch = initial_params(seed)
    summed = initial_params(seed)
    for batch in batches(len(y), 30, 12):
        for key, g in gradient(large_batch, x[batch], y[batch], len(batch)).items():
            large_batch[key] -= 0.5 * g
        parts = [
            gradient(summed, x[p], y[p], len(batch)) for p in np.array_split(batch, len(workers))
        ]
        for key in summed:
            total = parts[0][key].copy()
            for part in parts[1:]:
                total += part[key]
            summed[key] -= 0.5 * total
    for final in workers:
        for key in large_batch:
            diff = np.abs(final[key] - large_batch[key]).max()
            print(f"{key}: max |BSP - large batch| = {diff:.3g}")
            assert diff < 1e-6
            assert np.array_equal(final[key], summed[key])  # the same sum order: bit for bit
