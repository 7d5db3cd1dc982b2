"""Parameter servers (dsml.ps): sharding, optimizers, the server's rules, and real groups.

In-process groups run over real ZeroMQ sockets (`open_local_cluster`); the MNIST example
runs as real processes under `dsml run`.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dsml.ps as ps
from dsml.errors import ConfigError, ProtocolError
from dsml.ps.messages import (
    DONE,
    STEP,
    Request,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)
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


# -- the example, as real processes ---------------------------------------------------------

# 4 ranks on 2 cores: BLAS threads of each would fight over them (43 s an epoch, not 1 s)
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def run_example(consistency: str, *extra: str) -> float:
    script = ["examples/parameter_server.py", "--quick", "--servers", "1"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsml",
            "run",
            "-n",
            "3",
            *script,
            "--consistency",
            consistency,
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=80,
        cwd=ROOT,
        env={**os.environ, "DSML_DATA_DIR": "/nonexistent", **ONE_THREAD},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    found = re.fullmatch(r"\[rank 0\] accuracy: (0\.\d{4})", lines[-1])
    assert found, proc.stdout
    assert sum("accuracy:" in line for line in lines) == 1
    return float(found[1])


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_the_example_trains_mnist_under_bsp_and_async_to_the_same_accuracy():
    bsp = run_example("bsp")
    stale = run_example("async")
    print(f"MNIST quick, 2 workers + 1 server: bsp {bsp:.4f}, async {stale:.4f}")
    assert bsp > 0.85  # seeded: 0.8900 here
    # async is not deterministic: which worker's push lands first depends on the scheduler.
    # 0.879-0.900 seen (0.879 on a loaded 2-core CI machine, where one worker ran well ahead
    # of the other), so within 3% of BSP; the in-process tests count every push applied
    # exactly (1e-9: the accuracies are printed to 4 decimals)
    assert stale >= bsp - 0.03 - 1e-9


# -- units: sharding, optimizers, messages, the server's rules ----------------------------


@pytest.mark.parametrize("servers", [1, 2, 3, 4, 7])
def test_shard_covers_every_element_once_and_balances_by_size(servers):
    specs = [
        ps.KeySpec("big", (784, 128), np.dtype(np.float32)),
        ps.KeySpec("mid", (128, 64), np.dtype(np.float32)),
        ps.KeySpec("small", (10,), np.dtype(np.float64)),
        ps.KeySpec("empty", (0,), np.dtype(np.float32)),
    ]
    layout = ps.shard(specs, servers)
    for spec in specs:
        covered = np.zeros(spec.size, int)
        for piece in layout.pieces_of(spec.name):
            covered[piece.lo : piece.hi] += 1
        assert (covered == 1).all()
    loads = layout.load_bytes()
    biggest = max(p.nbytes for p in layout.pieces)
    assert max(loads) <= sum(loads) / servers + biggest  # the LPT bound
    assert layout == ps.shard(specs, servers)  # the same on every rank
    with pytest.raises(ConfigError, match="no parameter named 'nope'"):
        layout.pieces_of("nope")


def test_a_large_key_is_spread_over_the_servers():
    layout = ps.shard([ps.KeySpec("w", (1000, 100), np.dtype(np.float32))], 4)
    assert layout.load_bytes() == [100_000] * 4


def test_sgd_and_momentum_match_their_formulas():
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(6).astype(np.float32) for _ in range(3)]
    p, state = np.ones(6, np.float32), {}
    for step, g in enumerate(grads, 1):
        ps.SGD(0.1).apply(p, g, state, step)
    assert np.array_equal(
        p, np.ones(6, np.float32) - 0.1 * grads[0] - 0.1 * grads[1] - 0.1 * grads[2]
    )
    opt = ps.Momentum(0.1, 0.9)
    p, state = np.zeros(6), opt.init_state(np.zeros(6))
    v, ref = np.zeros(6), np.zeros(6)
    for step, g in enumerate(grads, 1):
        opt.apply(p, g.astype(np.float64), state, step)
        v = 0.9 * v + g
        ref -= 0.1 * v
    np.testing.assert_allclose(p, ref, rtol=1e-12)


def test_adam_matches_its_formula():
    opt = ps.Adam(0.01)
    g = np.array([0.5, -2.0, 1e-3])
    p, state = np.zeros(3), opt.init_state(np.zeros(3))
    m, v, ref = np.zeros(3), np.zeros(3), np.zeros(3)
    for step in range(1, 4):
        opt.apply(p, g * step, state, step)
        m = 0.9 * m + 0.1 * g * step
        v = 0.999 * v + 0.001 * (g * step) ** 2
        ref -= 0.01 * (m / (1 - 0.9**step)) / (np.sqrt(v / (1 - 0.999**step)) + 1e-8)
    np.testing.assert_allclose(p, ref, rtol=1e-12)
    with pytest.raises(ConfigError):
        ps.Adam(beta1=1.0)


def test_messages_round_trip_and_reject_what_does_not_fit():
    layout = ps.shard(
        [ps.KeySpec("a", (5,), np.dtype(np.float32)), ps.KeySpec("b", (3,), np.dtype(np.float64))],
        1,
    )
    a, b = layout.pieces
    grad = np.arange(5, dtype=np.float32)
    request = decode_request(encode_request(STEP, 7, [(a, grad)], [a, b]), layout, 0)
    assert (request.kind, request.seq, request.pull) == (STEP, 7, (a, b))
    assert np.array_equal(request.push[0][1], grad)
    reply = decode_reply(encode_reply(7, [(b, np.ones(3))]), layout)
    assert reply.seq == 7
    assert np.array_equal(reply.values[0][1], np.ones(3))
    good = encode_request(DONE, 1, [(a, grad)], [])
    with pytest.raises(ProtocolError, match=r"shorter|longer|malformed"):
        decode_request(good[:-8], layout, 0)
    with pytest.raises(ProtocolError, match="another server"):
        decode_request(good, layout, 1)
    with pytest.raises(ProtocolError, match="magic"):
        decode_request(np.zeros(64, np.uint8), layout, 0)


def step_request(seq: int, piece: ps.Piece, grad: float, pull: bool = True) -> Request:
    return Request(STEP, seq, ((piece, np.array([grad])),), (piece,) if pull else ())


def one_piece_state(consistency: str, staleness: int = 0, workers: int = 2) -> ps.ShardState:
    layout = ps.shard([ps.KeySpec("x", (1,), np.dtype(np.float64))], 1)
    return ps.ShardState(
        layout, 0, {"x": np.zeros(1)}, ps.SGD(1.0), range(workers), consistency, staleness
    )


def test_bsp_answers_a_pull_only_when_every_worker_pushed_the_step():
    state = one_piece_state("bsp")
    piece = next(iter(state.pieces))
    p = ps.shard([ps.KeySpec("x", (1,), np.dtype(np.float64))], 1).pieces[piece]
    assert state.handle(0, step_request(1, p, 1.0)) == []  # worker 1 has not pushed
    ready = state.handle(1, step_request(1, p, 2.0))
    assert sorted(o.worker for o in ready) == [0, 1]
    assert all(o.values[0][1][0] == -3.0 for o in ready)  # one step of the sum
    assert state.handle(0, step_request(1, p, 5.0)) != []  # a re-sent request: not applied again
    assert state.pieces[piece].value[0] == -3.0


def test_a_lost_worker_no_longer_holds_a_bsp_step_back():
    state = one_piece_state("bsp", workers=3)
    p = ps.shard([ps.KeySpec("x", (1,), np.dtype(np.float64))], 1).pieces[0]
    assert state.handle(0, step_request(1, p, 1.0)) == []
    assert state.handle(1, step_request(1, p, 2.0)) == []  # worker 2 has not pushed
    ready = state.drop(2)
    assert sorted(o.worker for o in ready) == [0, 1]
    assert state.pieces[0].value[0] == -3.0


def test_ssp_lets_a_worker_run_at_most_s_steps_ahead():
    state = one_piece_state("ssp", staleness=2)
    p = ps.shard([ps.KeySpec("x", (1,), np.dtype(np.float64))], 1).pieces[0]
    answered = [bool(state.handle(0, step_request(seq, p, 1.0))) for seq in range(1, 5)]
    assert answered == [True, True, False, False]  # clocks 1, 2 within 2 of worker 1's 0
    assert [o.seq for o in state.handle(1, step_request(1, p, 1.0))] == [3, 1]
    assert state.max_lead <= 2


def test_async_applies_each_push_on_arrival():
    state = one_piece_state("async")
    p = ps.shard([ps.KeySpec("x", (1,), np.dtype(np.float64))], 1).pieces[0]
    for seq in range(1, 4):
        assert state.handle(0, step_request(seq, p, 1.0))
    assert state.pieces[0].value[0] == -3.0


def test_config_refuses_what_it_cannot_do():
    with pytest.raises(ConfigError, match="consistency"):
        ps.PSConfig(consistency="eventual")
    with pytest.raises(ConfigError, match="staleness"):
        ps.PSConfig(consistency="bsp", staleness=2)


# -- faults: BSP re-forms over the survivors; a lost server is a typed error ----------------


@pytest.mark.timeout(40)
async def test_bsp_steps_re_form_over_the_survivors_when_a_worker_dies(seed):
    x, y = make_data(seed)
    config = ps.PSConfig(servers=1, consistency="bsp", optimizer=ps.SGD(0.5))
    plan = batches(len(y), 30, 20)

    async def rank(comm):
        async with ps.open_ps(comm, initial_params(seed), config) as node:
            if node.is_server:
                await node.serve()
                return node.stats()
            if node.index == 2:
                await train_worker_until(node, x, y, plan[:4])
                await crash(comm)
                return None
            return await train_worker(node, x, y, plan)

    async with open_local_cluster(4) as cluster:  # workers 0, 1, 2; server 3
        results = await cluster.run(rank)
    assert all(np.array_equal(results[0][k], results[1][k]) for k in results[0])
    server = results[3]
    assert server["lost"] == [2]
    assert set(server["updates"].values()) == {20}  # one update per step, none twice
    assert accuracy(results[0], x, y) > 0.8


@pytest.mark.timeout(40)
async def test_a_lost_server_fails_the_workers_calls_with_a_typed_error(seed):
    config = ps.PSConfig(servers=1, consistency="async")
    params = initial_params(seed)

    async def rank(comm):
        async with ps.open_ps(comm, params, config) as node:
            if node.is_server:
                await crash(comm)
                return None
            out = np.zeros_like(params["w"])
            with pytest.raises(ps.ServerLostError) as caught:
                await push_and_pull_forever(node, out)  # fails once the loss is seen
            with pytest.raises(ps.ServerLostError):
                await node.pull("w", out)  # and every later call, at once
            return caught.value.server

    async with open_local_cluster(3) as cluster:
        results = await cluster.run(rank)
    assert results[:2] == [0, 0]


async def push_and_pull_forever(node: ps.ParameterServers, out: np.ndarray) -> None:
    while True:
        node.push("w", np.ones_like(out))
        await node.pull("w", out)


@pytest.mark.timeout(30)
async def test_a_push_goes_through_the_engine_after_the_op_that_writes_the_gradient(seed):
    params = initial_params(seed)
    config = ps.PSConfig(servers=1, consistency="bsp", optimizer=ps.SGD(1.0))

    async def rank(comm):
        async with ps.open_ps(comm, params, config) as node:
            if node.is_server:
                await node.serve()
                return None
            grad = np.zeros_like(params["b"])
            grad_var = comm.engine.new_var("grad")

            def backward() -> None:  # runs in the engine's thread pool
                grad[:] = 1.0

            async def push() -> None:
                await node.push("b", grad)

            comm.engine.push(backward, read=[], mutate=[grad_var])
            comm.engine.push(push, read=[grad_var], mutate=[])
            await comm.engine.wait_all()
            final = {"b": np.zeros_like(params["b"])}
            await node.finish(pull=final)
            return final["b"]

    async with open_local_cluster(2) as cluster:
        results = await cluster.run(rank)
    assert np.array_equal(results[0], params["b"] - 1.0)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_kill_9_of_a_worker_process_under_async_lets_the_others_finish(tmp_path):
    registry = subprocess.Popen(
        [sys.executable, "-m", "dsml", "registry", "--address", "tcp://127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
    )
    ranks: list[subprocess.Popen[str]] = []
    try:
        assert registry.stdout is not None
        address = registry.stdout.readline().split()[4]
        script = ["examples/parameter_server.py", "--quick", "--consistency", "async"]
        for rank in range(4):  # workers 0, 1, 2; server 3
            env = {**os.environ, "DSML_REGISTRY": address, "DSML_WORLD_SIZE": "4"}
            env.update(DSML_RANK=str(rank), DSML_DATA_DIR="/nonexistent", **ONE_THREAD)
            ranks.append(
                subprocess.Popen(
                    [sys.executable, *script],
                    stdout=subprocess.PIPE,
                    stderr=(tmp_path / f"rank{rank}.err").open("w"),
                    text=True,
                    cwd=ROOT,
                    env=env,
                )
            )
        assert ranks[0].stdout is not None
        seen = []
        for line in ranks[0].stdout:  # rank 0 is half way: kill worker 1
            seen.append(line)
            if line.startswith("epoch 1/"):
                break
        ranks[1].kill()
        out, _ = ranks[0].communicate(timeout=60)
        lines = [*seen, *out.splitlines()]
        logs = "\n".join(p.read_text() for p in sorted(tmp_path.glob("rank*.err")))
        for proc in (ranks[0], ranks[2], ranks[3]):
            assert proc.wait(timeout=30) == 0, logs
        found = re.fullmatch(r"accuracy: (0\.\d{4})", lines[-1].strip())
        assert found, lines
        assert float(found[1]) > 0.8
    finally:
        for proc in [*ranks, registry]:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


@pytest.mark.timeout(30)
async def test_bsp_trains_the_mnist_mlp_as_the_summed_gradients_do_bit_for_bit(seed):
    sys.path.insert(0, str(ROOT / "examples"))
    import parameter_server as example
    from mnist.mlp import MLP

    rng = np.random.default_rng(seed)
    images = rng.random((120, 784), dtype=np.float32)
    labels = rng.integers(0, 10, 120)
    plan = batches(len(labels), 40, 6)
    config = ps.PSConfig(servers=2, consistency="bsp", optimizer=ps.SGD(0.1))

    async def rank(comm):
        model = MLP(seed=seed)
        async with ps.open_ps(comm, example.tensors(model), config) as node:
            if node.is_server:
                await node.serve()
                return None
            for batch in plan:
                mine = np.array_split(batch, node.num_workers)[node.index]
                model.loss_and_grad(images[mine], labels[mine], normalizer=len(batch))
                for key, grad in example.tensors(model, grads=True).items():
                    node.push(key, grad)
                await example.pull_all(node, model)
            await node.finish()
            return model.params.copy()

    async with open_local_cluster(5) as cluster:  # workers 0, 1, 2; servers 3, 4
        results = await cluster.run(rank)
    summed, large = MLP(seed=seed), MLP(seed=seed)
    for batch in plan:
        parts = []
        for part in np.array_split(batch, 3):
            summed.loss_and_grad(images[part], labels[part], normalizer=len(batch))
            parts.append(summed.grads.copy())
        total = parts[0]
        for grad in parts[1:]:  # in worker order, as the servers add them
            total += grad
        summed.params -= np.float32(0.1) * total
        large.loss_and_grad(images[batch], labels[batch], normalizer=len(batch))
        large.sgd_step(0.1)
    for params in results[:3]:
        assert np.array_equal(params, summed.params)
    diff = float(np.abs(results[0] - large.params).max())
    print(f"float32 MLP: max |BSP - large batch| = {diff:.3g}")
    assert diff < 1e-5  # float32 sums in another order
