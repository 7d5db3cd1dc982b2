"""Training strategies and compression (dsml.train) on real groups over ZeroMQ sockets.

The groups run in-process over real sockets (`open_local_cluster`); the example script
runs as real processes under `dsml run`. Each rank trains the float64 softmax regression
of tests/test_ps.py on its own part of every batch, so references computed in numpy agree
with the groups to float rounding.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dsml.ps as ps
import dsml.train as train
from dsml.errors import ConfigError
from dsml.testing import open_local_cluster
from tests.test_ps import accuracy, batches, gradient, initial_params, make_data

ROOT = Path(__file__).resolve().parent.parent
LR = 0.5


def local_part(batch: np.ndarray, rank: int, size: int) -> np.ndarray:
    return np.array_split(batch, size)[rank]


async def run_strategy(
    size: int, config: train.StrategyConfig, seed: int, steps: int = 12, batch: int = 40
) -> list[tuple[dict[str, np.ndarray], dict[str, object]]]:
    """Every rank: the mean-loss gradient of its part of each batch, then strategy.step."""
    x, y = make_data(seed)
    plan = batches(len(y), batch, steps)

    async def rank(comm):
        params = initial_params(seed) if comm.rank == 0 else initial_params(seed + 7)
        async with train.open_strategy(comm, params, config) as strategy:
            for b in plan:
                mine = local_part(b, comm.rank, comm.world_size)
                await strategy.step(params, gradient(params, x[mine], y[mine], len(mine)))
            await strategy.finish(params)
            return params, strategy.stats()

    async with open_local_cluster(size) as cluster:
        return await cluster.run(rank)


def reference_local_sgd(size: int, seed: int, steps: int, period: int, batch: int = 40):
    """Local SGD in numpy: each rank's SGD steps, parameters averaged every period steps
    and at the end."""
    x, y = make_data(seed)
    ranks = [initial_params(seed) for _ in range(size)]
    for t, b in enumerate(batches(len(y), batch, steps), 1):
        for r, params in enumerate(ranks):
            mine = local_part(b, r, size)
            for key, g in gradient(params, x[mine], y[mine], len(mine)).items():
                params[key] -= LR * g
        if t % period == 0 or t == steps:
            for key in ranks[0]:
                mean = sum(p[key] for p in ranks) / size
                for p in ranks:
                    p[key] = mean.copy()
    return ranks[0]


# -- strategies -------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
async def test_local_sgd_with_period_1_takes_the_steps_of_gradient_averaging(size, seed):
    grad = await run_strategy(size, train.StrategyConfig("grad", ps.SGD(LR)), seed)
    local = await run_strategy(size, train.StrategyConfig("local_sgd", ps.SGD(LR), period=1), seed)
    for (g, _), (w, _) in zip(grad, local, strict=True):
        for key in g:
            assert np.abs(g[key] - w[key]).max() < 1e-12
    assert grad[0][1]["syncs"] == local[0][1]["syncs"] == 12


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("size", "period", "steps"), [(2, 4, 12), (3, 5, 12), (4, 3, 10)])
async def test_local_sgd_averages_every_period_steps_and_the_ranks_end_equal(
    size, period, steps, seed
):
    config = train.StrategyConfig("local_sgd", ps.SGD(LR), period=period)
    results = await run_strategy(size, config, seed, steps=steps)
    expected = reference_local_sgd(size, seed, steps, period)
    for params, stats in results:
        for key in params:
            assert np.array_equal(params[key], results[0][0][key])  # bitwise, every rank
            assert np.abs(params[key] - expected[key]).max() < 1e-12
        assert stats["syncs"] == math.ceil(steps / period)
        model_bytes = sum(v.nbytes for v in expected.values())
        assert stats["payload_bytes"] == stats["syncs"] * model_bytes


@pytest.mark.timeout(60)
async def test_diloco_steps_nesterov_momentum_on_the_averaged_pseudo_gradient(seed):
    size, period, steps = 3, 4, 12
    config = train.StrategyConfig(
        "diloco", ps.SGD(LR), period=period, outer_lr=0.7, outer_momentum=0.9
    )
    results = await run_strategy(size, config, seed, steps=steps)
    x, y = make_data(seed)
    anchor = initial_params(seed)
    velocity = {k: np.zeros_like(v) for k, v in anchor.items()}
    ranks = [{k: v.copy() for k, v in anchor.items()} for _ in range(size)]
    for t, b in enumerate(batches(len(y), 40, steps), 1):
        for r, params in enumerate(ranks):
            mine = local_part(b, r, size)
            for key, g in gradient(params, x[mine], y[mine], len(mine)).items():
                params[key] -= LR * g
        if t % period == 0:
            for key in anchor:
                delta = sum(anchor[key] - p[key] for p in ranks) / size
                velocity[key] = 0.9 * velocity[key] + delta
                anchor[key] = anchor[key] - 0.7 * (delta + 0.9 * velocity[key])
                for p in ranks:
                    p[key] = anchor[key].copy()
    for params, stats in results:
        assert stats["syncs"] == steps // period
        for key in params:
            assert np.array_equal(params[key], results[0][0][key])
            assert np.abs(params[key] - anchor[key]).max() < 1e-12


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("strategy", "period", "compression"),
    [
        ("grad", 1, "bf16"),
        ("grad", 1, "fp16"),
        ("grad", 1, "topk:0.1"),
        ("grad", 1, "powersgd:2"),
        ("local_sgd", 4, "none"),
        ("diloco", 4, "none"),
        ("diloco", 4, "bf16"),
    ],
)
async def test_every_strategy_trains_as_well_as_plain_gradient_averaging(
    strategy, period, compression, seed
):
    x, y = make_data(seed)
    base = await run_strategy(3, train.StrategyConfig("grad", ps.SGD(LR)), seed, steps=40)
    config = train.StrategyConfig(strategy, ps.SGD(LR), period=period, compression=compression)
    other = await run_strategy(3, config, seed, steps=40)
    base_accuracy, other_accuracy = accuracy(base[0][0], x, y), accuracy(other[0][0], x, y)
    print(f"grad {base_accuracy:.4f}, {strategy}/{period}/{compression} {other_accuracy:.4f}")
    assert base_accuracy > 0.8
    assert other_accuracy >= base_accuracy - 0.05
    for params, _ in other:  # every rank ends with the same parameters
        assert all(np.array_equal(params[k], other[0][0][k]) for k in params)


def test_config_refuses_what_it_cannot_do():
    with pytest.raises(ConfigError, match="strategy must be one of"):
        train.StrategyConfig("hogwild")
    with pytest.raises(ConfigError, match="period"):
        train.StrategyConfig("grad", period=4)
    with pytest.raises(ConfigError, match="diloco"):
        train.StrategyConfig("local_sgd", period=4, compression="bf16")
    with pytest.raises(ConfigError, match="compression"):
        train.StrategyConfig("grad", compression="zip")
    with pytest.raises(ConfigError, match="ratio"):
        train.compressor_from("topk:2")


# -- compression: bytes and error feedback ---------------------------------------------------


def shapes() -> dict[str, tuple[int, ...]]:
    return {"w": (64, 48), "b": (48,), "v": (30, 20)}


async def run_compressor(size: int, spec: str, seed: int, steps: int = 6):
    """Each rank averages its own random gradients `steps` times; per rank: (what it
    pushed in, summed; what came out, summed; its residual; its traffic)."""

    async def rank(comm):
        rng = np.random.default_rng([seed, comm.rank])
        compressor = train.compressor_from(spec)
        pushed = {k: np.zeros(s) for k, s in shapes().items()}
        received = {k: np.zeros(s) for k, s in shapes().items()}
        for _ in range(steps):
            grads = {k: rng.standard_normal(s) for k, s in shapes().items()}
            for k in grads:
                pushed[k] += grads[k]
            await compressor.average(comm, grads)
            for k in grads:
                received[k] += grads[k]
        return pushed, received, compressor

    async with open_local_cluster(size) as cluster:
        return await cluster.run(rank)


N_ELEMENTS = sum(math.prod(s) for s in shapes().values())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spec", ["bf16", "fp16"])
async def test_casting_halves_the_bytes_and_keeps_three_digits(spec, seed):
    size, steps = 3, 4
    results = await run_compressor(size, spec, seed, steps)
    mean_pushed = {k: sum(r[0][k] for r in results) / size for k in shapes()}
    for _, received, compressor in results:
        assert compressor.traffic.payload_bytes == steps * N_ELEMENTS * 2  # 2-byte floats
        assert compressor.traffic.sent_bytes == steps * (2 * (size - 1) * N_ELEMENTS * 2 // size)
        for k in shapes():
            assert np.array_equal(received[k], results[0][1][k])  # every rank the same
            scale = np.abs(mean_pushed[k]).max()
            error = np.abs(received[k] - mean_pushed[k]).max() / scale
            tolerance = 0.05 if spec == "bf16" else 0.005  # 8 and 11 bits of mantissa
            assert error < tolerance, error


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 2, 4])
async def test_topk_sends_k_entries_and_error_feedback_keeps_the_sum(size, seed):
    steps, ratio = 6, 0.05
    results = await run_compressor(size, f"topk:{ratio}", seed, steps)
    k = math.ceil(ratio * N_ELEMENTS)
    for _, received, compressor in results:
        assert compressor.traffic.payload_bytes == steps * k * (4 + 8)  # int32 index, float64
        assert np.count_nonzero(compressor.residual) <= N_ELEMENTS - k
        assert np.array_equal(received["w"], results[0][1]["w"])  # every rank the same
    # error feedback: the averages received over all steps are the mean over the ranks of
    # all they were given minus what each still holds (nothing lost, nothing twice)
    mean_sent = (
        sum(
            np.concatenate([r[0][k].reshape(-1) for k in shapes()]) - r[2].residual for r in results
        )
        / size
    )
    received = np.concatenate([results[0][1][k].reshape(-1) for k in shapes()])
    assert np.abs(received - mean_sent).max() < 1e-9


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 2, 3])
async def test_powersgd_sends_rank_r_factors_and_error_feedback_keeps_the_sum(size, seed):
    steps, r = 6, 3
    results = await run_compressor(size, f"powersgd:{r}", seed, steps)
    # w (64x48) and v (30x20) go as rank-3 factors P and Q; b (48) uncompressed
    per_step = (64 + 48) * r + (30 + 20) * r + 48
    for pushed, received, compressor in results:
        assert compressor.traffic.payload_bytes == steps * per_step * 8
        assert compressor.traffic.calls == 2 * steps
        for k in ("w", "v"):
            # the rank-r approximations received plus this rank's error are what it pushed
            kept = compressor.error[k].reshape(shapes()[k])
            assert np.abs(received[k] + kept - pushed[k]).max() < 1e-9
            assert np.array_equal(received[k], results[0][1][k])  # every rank the same
    mean_b = sum(res[0]["b"] for res in results) / size
    assert np.abs(results[0][1]["b"] - mean_b).max() < 1e-12  # the vector: exact mean
    assert per_step < N_ELEMENTS / 5  # what it saves here: 5x fewer bytes


# -- the example, as real processes ---------------------------------------------------------

ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def run_example(*args: str, n: int = 2) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "dsml", "run", "-n", str(n), "examples/train_strategies.py", *args],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=ROOT,
        env={**os.environ, "DSML_DATA_DIR": "/nonexistent", **ONE_THREAD},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [line for line in proc.stdout.splitlines() if line.strip()]


def final_accuracy(lines: list[str]) -> float:
    found = re.fullmatch(r"\[rank 0\] accuracy: (0\.\d{4})", lines[-1])
    assert found, lines
    return float(found[1])


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_example_switches_strategy_with_one_argument_and_each_trains_mnist():
    accuracies = {}
    for strategy in (["grad"], ["local_sgd", "--period", "4"], ["grad", "--compression", "bf16"]):
        lines = run_example("--quick", "--strategy", *strategy)
        accuracies[" ".join(strategy)] = final_accuracy(lines)
        assert any("bytes per step" in line for line in lines), lines
    print(f"MNIST quick, 2 ranks: {accuracies}")
    base = accuracies["grad"]
    assert base > 0.85
    for name, value in accuracies.items():
        assert value >= base - 0.02, (name, value)
