"""Replicated parameter-server shards (`PSConfig(replicas=1)`): a lost server's shard is
served by its backup, and training goes on as if nothing happened.

In process, over real sockets: a server crashes (as under SIGKILL) half way through a BSP
run; the workers finish, and their parameters must be bitwise those of the same run
without the fault: every step applied once, none lost, none twice. The real-process
`kill -9` of a primary is in tests/test_ps_faults.py.
"""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

import dsml.ps as ps
from dsml.errors import ConfigError
from dsml.testing import crash, open_local_cluster
from tests.test_ps import batches, gradient, initial_params, make_data

STEPS, BATCH, LR = 16, 30, 0.5


def summed_reference(seed: int, workers: int) -> dict[str, np.ndarray]:
    """BSP without faults: each step, the workers' gradients summed in worker order."""
    x, y = make_data(seed)
    params = initial_params(seed)
    for batch in batches(len(y), BATCH, STEPS):
        parts = [gradient(params, x[p], y[p], len(batch)) for p in np.array_split(batch, workers)]
        for key in params:
            total = parts[0][key].copy()
            for part in parts[1:]:
                total += part[key]
            params[key] -= LR * total
    return params


async def run_with_a_lost_server(size: int, servers: int, victim: int, consistency: str, seed: int):
    """Workers train STEPS steps; server `victim` crashes once worker 0 has done half."""
    x, y = make_data(seed)
    plan = batches(len(y), BATCH, STEPS)
    config = ps.PSConfig(
        servers=servers,
        consistency=consistency,
        optimizer=ps.SGD(LR),
        replicas=1,
        max_piece_bytes=64,  # every key cut: each server holds pieces of both keys
    )
    half_way = asyncio.Event()

    async def rank(comm):
        async with ps.open_ps(comm, initial_params(seed), config) as node:
            if node.is_server and node.index == victim:
                serving = asyncio.ensure_future(node.serve())
                await half_way.wait()
                await crash(comm)
                serving.cancel()
                with contextlib.suppress(BaseException):
                    await serving
                return None
            if node.is_server:
                await node.serve()
                return node.stats()
            params = {k: np.zeros(s.shape) for k, s in node.layout.keys.items()}
            await asyncio.gather(*(node.pull(k, v) for k, v in params.items()))
            for step, batch in enumerate(plan):
                mine = np.array_split(batch, node.num_workers)[node.index]
                for key, g in gradient(params, x[mine], y[mine], len(batch)).items():
                    node.push(key, g)
                await asyncio.gather(*(node.pull(k, v) for k, v in params.items()))
                if node.index == 0 and step == STEPS // 2:
                    half_way.set()
            final = {k: np.zeros_like(v) for k, v in params.items()}
            await node.finish(pull=final)
            return final

    async with open_local_cluster(size) as cluster:
        return await cluster.run(rank)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("size", "servers", "victim"), [(5, 2, 0), (5, 2, 1), (6, 3, 1)])
async def test_bsp_goes_on_bitwise_when_a_replicated_server_is_lost(size, servers, victim, seed):
    results = await run_with_a_lost_server(size, servers, victim, "bsp", seed)
    workers = size - servers
    expected = summed_reference(seed, workers)
    for final in results[:workers]:
        for key in expected:
            assert np.array_equal(final[key], expected[key]), key  # as if nothing happened
    backup = results[workers + (victim + 1) % servers]
    assert backup["replica"]["took_over"] is True
    assert backup["replica"]["shard"] == victim
    assert set(backup["replica"]["updates"].values()) == {STEPS}  # once per step, none twice
    assert set(backup["updates"].values()) == {STEPS}


@pytest.mark.timeout(60)
async def test_async_loses_no_push_when_a_replicated_server_is_lost(seed):
    results = await run_with_a_lost_server(5, 2, 0, "async", seed)
    backup = results[4]
    assert backup["replica"]["took_over"] is True
    # 3 workers x STEPS pushes per piece, each applied once, by the primary or the backup
    assert set(backup["replica"]["updates"].values()) == {3 * STEPS}
    assert set(backup["updates"].values()) == {3 * STEPS}
    for final in results[1:3]:  # every worker ends with the same final pull
        assert all(np.array_equal(final[k], results[0][k]) for k in final)


def test_replicas_need_two_servers():
    with pytest.raises(ConfigError, match="servers >= 2"):
        ps.PSConfig(servers=1, replicas=1)
    with pytest.raises(ConfigError, match="0 or 1"):
        ps.PSConfig(servers=3, replicas=2)
