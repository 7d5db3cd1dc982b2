"""Compressed parameter-server pushes (dsml.ps push codecs) on real groups over sockets.

Bytes are those of the request messages the workers really sent (`node.stats()`); error
feedback is checked end to end: with async SGD(lr=1) a server's parameters move by exactly
the sum of what it decoded, which must be every gradient pushed minus the residuals the
workers still hold.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import dsml.ps as ps
from dsml.errors import ConfigError, ProtocolError
from dsml.testing import open_local_cluster
from tests.test_ps import accuracy, batches, gradient, initial_params, make_data


def piece(size: int, dtype=np.float64) -> ps.Piece:
    return ps.shard([ps.KeySpec("g", (size,), np.dtype(dtype))], 1).pieces[0]


@pytest.mark.parametrize("spec", ["none", "bf16", "fp16", "topk:0.25"])
def test_push_codecs_round_trip_within_their_precision(spec):
    p = piece(40)
    grad = np.random.default_rng(0).standard_normal(40)
    codec = ps.push_codec_from(spec)
    payload = codec.encode(p, grad)
    assert payload.dtype == np.uint8
    assert payload.nbytes == codec.payload_nbytes(p)
    back = codec.decode(p, payload)
    assert back.dtype == p.dtype
    assert back.shape == (40,)
    if spec == "none":
        assert np.array_equal(back, grad)
    elif spec in ("bf16", "fp16"):
        assert np.abs(back - grad).max() < (0.02 if spec == "bf16" else 0.002) * np.abs(grad).max()
    else:  # the 10 largest entries exactly, the rest kept as the residual
        assert np.count_nonzero(back) == 10
        assert np.array_equal(back + codec.residual[p.index], grad)


def test_a_top_k_push_with_an_index_out_of_range_is_a_protocol_error():
    p = piece(8)
    codec = ps.TopKPush(0.25)
    payload = codec.encode(p, np.arange(8.0)).copy()
    payload[:4] = np.array([99], np.int32).view(np.uint8)
    with pytest.raises(ProtocolError, match="out of range"):
        codec.decode(p, payload)
    with pytest.raises(ConfigError, match="PowerSGD"):
        ps.PSConfig(push_compression="powersgd")


@pytest.mark.timeout(60)
async def test_top_k_error_feedback_the_server_applies_every_push_but_the_residuals(seed):
    steps, shape = 8, (30, 7)
    config = ps.PSConfig(
        servers=1, consistency="async", optimizer=ps.SGD(1.0), push_compression="topk:0.1"
    )
    start = {"w": np.zeros(shape)}

    async def rank(comm):
        async with ps.open_ps(comm, start, config) as node:
            if node.is_server:
                await node.serve()
                return None
            rng = np.random.default_rng([seed, node.index])
            grads = [rng.standard_normal(shape) for _ in range(steps)]
            for g in grads:
                await node.push("w", g)
            final = {"w": np.zeros(shape)}
            await node.finish(pull=final)
            replay = ps.TopKPush(0.1)  # the same codec, deterministic: the same residual
            for g in grads:
                replay.encode(node.layout.pieces[0], g.reshape(-1))
            held = replay.residual[0].reshape(shape)
            return final["w"], sum(grads) - held

    async with open_local_cluster(3) as cluster:  # workers 0, 1; server 2
        results = await cluster.run(rank)
    (final, sent0), (_, sent1) = results[0], results[1]
    assert np.abs(final - (-(sent0 + sent1))).max() < 1e-9  # SGD(1): minus all that arrived
    assert np.count_nonzero(sent0) < sent0.size  # something really was held back


async def train_and_measure(config: ps.PSConfig, seed: int, steps: int = 40):
    """3 workers and 1 server train the softmax model; (worker 0's parameters, the bytes
    each worker sent and received)."""
    x, y = make_data(seed)
    plan = batches(len(y), 30, steps)

    async def rank(comm):
        async with ps.open_ps(comm, initial_params(seed), config) as node:
            if node.is_server:
                await node.serve()
                return None
            params = {k: np.zeros(s.shape) for k, s in node.layout.keys.items()}
            await asyncio.gather(*(node.pull(k, v) for k, v in params.items()))
            for batch in plan:
                mine = np.array_split(batch, node.num_workers)[node.index]
                for key, g in gradient(params, x[mine], y[mine], len(batch)).items():
                    node.push(key, g)
                await asyncio.gather(*(node.pull(k, v) for k, v in params.items()))
            await node.finish()
            return params, node.stats()

    async with open_local_cluster(4) as cluster:
        results = await cluster.run(rank)
    return results[0][0], [r[1] for r in results[:3]]


def request_bytes(spec: str, seed: int, steps: int) -> int:
    """What a worker's requests must add up to: the first pull, one request per step
    (header words, every piece's payload padded to 8 bytes), the DONE request."""
    layout = ps.shard([ps.KeySpec.of(k, v) for k, v in initial_params(seed).items()], 1)
    codec, pieces = ps.push_codec_from(spec), len(layout.pieces)
    payload = sum(-(-codec.payload_nbytes(p) // 8) * 8 for p in layout.pieces)
    return 8 * (5 + pieces) + steps * (8 * (5 + 2 * pieces) + payload) + 8 * 5


@pytest.mark.timeout(90)
@pytest.mark.parametrize("spec", ["bf16", "fp16", "topk:0.1"])
async def test_compressed_pushes_send_fewer_bytes_and_bsp_trains_as_well(spec, seed):
    x, y = make_data(seed)
    plain, plain_traffic = await train_and_measure(ps.PSConfig(optimizer=ps.SGD(0.5)), seed)
    config = ps.PSConfig(optimizer=ps.SGD(0.5), push_compression=spec)
    small, small_traffic = await train_and_measure(config, seed)
    ratio = small_traffic[0]["sent_bytes"] / plain_traffic[0]["sent_bytes"]
    print(
        f"{spec}: {ratio:.3f} of the request bytes; accuracy {accuracy(small, x, y):.4f} "
        f"against {accuracy(plain, x, y):.4f} uncompressed"
    )
    for plain_w, small_w in zip(plain_traffic, small_traffic, strict=True):
        assert plain_w["sent_bytes"] == request_bytes("none", seed, 40)
        assert small_w["sent_bytes"] == request_bytes(spec, seed, 40)  # measured = computed
        assert small_w["received_bytes"] == plain_w["received_bytes"]  # pulls stay dense
    assert ratio < 0.5
    assert accuracy(small, x, y) >= accuracy(plain, x, y) - 0.05
