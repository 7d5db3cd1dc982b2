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
from dsml.testing import crash, open_local_cluster

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


# -- async and SSP ------------------------------------------------------------------------


def accuracy(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    return float(((x @ params["w"] + params["b"]).argmax(axis=1) == y).mean())


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("consistency", "staleness"), [("async", 0), ("ssp", 1), ("ssp", 3)])
async def test_stale_consistency_trains_as_well_as_bsp_and_ssp_bounds_the_lead(
    consistency, staleness, seed
):
    x, y = make_data(seed)
    bsp = await run_group(4, ps.PSConfig(servers=1, optimizer=ps.SGD(0.5)), seed, steps=40)
    config = ps.PSConfig(
        servers=1, consistency=consistency, staleness=staleness, optimizer=ps.SGD(0.5)
    )
    stale = await run_group(4, config, seed, steps=40)
    bsp_accuracy, stale_accuracy = accuracy(bsp[0], x, y), accuracy(stale[0], x, y)
    print(f"bsp {bsp_accuracy:.4f}, {consistency} (s={staleness}) {stale_accuracy:.4f}")
    assert stale_accuracy >= bsp_accuracy - 0.05
    server = stale[-1]
    assert sum(server["updates"].values()) == 3 * 40 * len(server["updates"])  # none lost
    if consistency == "ssp":
        assert server["max_lead"] <= staleness


@pytest.mark.timeout(40)
async def test_async_training_goes_on_when_a_worker_dies(seed):
    x, y = make_data(seed)
    config = ps.PSConfig(servers=2, consistency="async", optimizer=ps.SGD(0.5), max_piece_bytes=64)
    plan = batches(len(y), 30, 30)

    async def rank(comm):
        async with ps.open_ps(comm, initial_params(seed), config) as node:
            if node.is_server:
                await node.serve()
                return node.stats()
            if node.index == 1:  # dies like kill -9 after 5 steps
                await train_worker_until(node, x, y, plan[:5])
                await crash(comm)
                return None
            return await train_worker(node, x, y, plan)

    async with open_local_cluster(5) as cluster:  # workers 0, 1, 2; servers 3, 4
        results = await cluster.run(rank)
    assert results[1] is None
    assert accuracy(results[0], x, y) > 0.8
    for server in results[3:]:
        assert server["lost"] == [1]
        # 2 workers x 30 steps + the dead one's 5 (its last push may or may not have landed)
        per_piece = set(server["updates"].values())
        assert per_piece <= {65, 66}, per_piece


async def train_worker_until(
    node: ps.ParameterServers, x: np.ndarray, y: np.ndarray, steps: list[np.ndarray]
) -> None:
    params = {k: np.zeros(s.shape) for k, s in node.layout.keys.items()}
    await asyncio.gather(*(node.pull(k, v) for k, v in params.items()))
    for batch in steps:
        mine = np.array_split(batch, node.num_workers)[node.index]
        for key, g in gradient(params, x[mine], y[mine], len(batch)).items():
            node.push(key, g)
        await asyncio.gather(*(node.pull(k, v) for k, v in params.items()))
