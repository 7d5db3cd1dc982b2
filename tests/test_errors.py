"""Mismatched calls, missing ranks and bad input: a clear error on every rank, never a hang.

The collective timeout is set far above pytest's, so a test that passes proves the error
came from detection (a fingerprint check, an abort), not from waiting out a timeout.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import dsml
from dsml import (
    CollectiveAbortedError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommConfig,
    ConfigError,
)
from dsml.testing import open_local_cluster

PATIENT = CommConfig(timeout=300)


async def outcomes(cluster, fn):
    """Run fn(comm) on every rank; exceptions are returned, not raised."""
    return await asyncio.gather(*(fn(c) for c in cluster), return_exceptions=True)


def assert_all(results, error_type, *words):
    for rank, result in enumerate(results):
        assert isinstance(result, error_type), f"rank {rank} got {result!r}"
        for word in words:
            assert word in str(result), f"rank {rank}: {word!r} not in {result}"


async def assert_still_usable(cluster):
    xs = [np.full(3, c.rank, dtype=np.int64) for c in cluster]
    await cluster.run(lambda c: c.all_reduce(xs[c.rank]))
    assert all((x == sum(range(len(cluster)))).all() for x in xs)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "naive", "direct", "mesh"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
async def test_a_different_shape_fails_every_rank_with_a_mismatch_naming_both(
    world_size, algorithm
):
    async with open_local_cluster(world_size, config=PATIENT) as cluster:
        odd = world_size - 1
        xs = [np.arange(8 if r != odd else 6, dtype=np.float32) for r in range(world_size)]
        originals = [x.copy() for x in xs]
        results = await outcomes(cluster, lambda c: c.all_reduce(xs[c.rank], algorithm=algorithm))
        assert_all(results, CollectiveMismatchError, "shape=(8,)", "shape=(6,)", f"rank {odd}")
        for x, original in zip(xs, originals, strict=True):
            np.testing.assert_array_equal(x, original)  # inputs intact
        assert all(r.cid == results[0].cid for r in results)
        await assert_still_usable(cluster)


@pytest.mark.parametrize(
    ("field", "make"),
    [
        ("dtype", lambda r: (np.ones(8, np.float32 if r else np.float64), "sum")),
        ("op", lambda r: (np.ones(8, np.float32), "max" if r == 1 else "sum")),
    ],
)
async def test_a_different_dtype_or_op_fails_every_rank(field, make):
    async with open_local_cluster(3, config=PATIENT) as cluster:
        args = [make(r) for r in range(3)]
        results = await outcomes(cluster, lambda c: c.all_reduce(*args[c.rank]))
        assert_all(results, CollectiveMismatchError, f"different {field}")
        await assert_still_usable(cluster)


@pytest.mark.parametrize("collective", ["broadcast", "reduce", "gather", "scatter"])
async def test_a_different_root_fails_every_rank_including_the_roots(collective):
    async with open_local_cluster(4, config=PATIENT) as cluster:

        def call(c):
            root = 1 if c.rank == 3 else 0
            method = getattr(c, collective)
            if collective == "scatter":
                return method(np.arange(8.0) if c.rank == root else None, root)
            return method(np.ones(4), root)

        results = await outcomes(cluster, call)
        assert_all(results, CollectiveMismatchError, "root=")
        await assert_still_usable(cluster)


async def test_the_broadcast_root_fails_when_a_non_root_rejects_the_call():
    async with open_local_cluster(4, config=PATIENT) as cluster:
        xs = [np.ones(16) if r != 3 else np.ones(9) for r in range(4)]
        results = await outcomes(cluster, lambda c: c.broadcast(xs[c.rank], 0))
        assert_all(results, CollectiveMismatchError)
        assert isinstance(results[0], CollectiveMismatchError)  # the root too


@pytest.mark.parametrize("collective", ["all_reduce", "broadcast"])
async def test_a_different_chunk_size_is_a_mismatch_on_every_rank(collective):
    """Ranks cutting messages differently cannot work together; the root must not succeed."""
    registry = await dsml.open_registry()
    try:
        configs = [CommConfig(timeout=300, chunk_bytes=4096 * (1 + r)) for r in range(3)]
        comms = await asyncio.gather(
            *(
                dsml.init(registry.address, world_size=3, rank=r, config=c)
                for r, c in enumerate(configs)
            )
        )
        try:
            results = await asyncio.gather(
                *(getattr(c, collective)(np.ones(20000)) for c in comms), return_exceptions=True
            )
            assert_all(results, CollectiveMismatchError, "chunk_bytes")
        finally:
            await asyncio.gather(*(c.aclose() for c in comms))
    finally:
        await registry.aclose()


async def test_nobody_waits_when_every_rank_thinks_another_is_the_root():
    async with open_local_cluster(2, config=PATIENT) as cluster:
        results = await outcomes(cluster, lambda c: c.broadcast(np.ones(4), 1 - c.rank))
        assert_all(results, CollectiveMismatchError, "root=0", "root=1")


@pytest.mark.parametrize(
    "second", ["broadcast", "barrier", "all_gather", "reduce_scatter", "all_to_all"]
)
async def test_different_kinds_of_collective_fail_every_rank(second):
    async with open_local_cluster(3, config=PATIENT) as cluster:

        def call(c):
            if c.rank != 1:
                return c.all_reduce(np.ones(6))
            return c.barrier() if second == "barrier" else getattr(c, second)(np.ones(6))

        results = await outcomes(cluster, call)
        assert_all(results, CollectiveMismatchError, "all_reduce", second)
        await assert_still_usable(cluster)


async def test_an_extra_call_fails_once_the_peers_close():
    async with open_local_cluster(3, config=PATIENT) as cluster:
        await cluster.run(lambda c: c.barrier())
        extra = cluster[0].all_reduce(np.ones(4))
        await asyncio.gather(cluster[1].aclose(), cluster[2].aclose())
        with pytest.raises(dsml.MemberLeftError, match="closed its communicator"):
            await extra


async def test_a_missing_call_times_out_naming_the_rank_that_never_arrived():
    config = CommConfig(timeout=0.5, probe_timeout=0.3)
    async with open_local_cluster(4, config=config) as cluster:
        xs = [np.ones(1000) for _ in range(4)]
        results = await outcomes(cluster, lambda c: _skip(c, xs))
        timeouts = {i: r for i, r in enumerate(results) if i != 2}
        assert_all(timeouts.values(), CollectiveTimeoutError)
        # A rank whose own deadline fired names the missing rank. A rank whose peer's
        # deadline fired first is given up by that peer's probe (which rank that is
        # depends on scheduling) and points at the peer whose error names rank 2.
        diagnosed = {i: t for i, t in timeouts.items() if t.missing}
        assert diagnosed, f"no rank diagnosed the timeout: {timeouts}"
        for t in diagnosed.values():
            assert "rank 2 has not arrived" in str(t), t
            assert t.missing == (2,), t
        for i, t in timeouts.items():
            if i not in diagnosed:
                prober = int(str(t).split()[1])
                assert "gave it up" in str(t), (i, t)
                assert prober in diagnosed, (i, t)
        assert all((x == 1).all() for x in xs)
        # The late rank's call fails at once: its peers have given it up.
        with pytest.raises(
            CollectiveTimeoutError, match="rank 2 arrived at collective #1 too late"
        ):
            await cluster[2].all_reduce(xs[2])


async def _skip(comm, xs):
    """Rank 2 makes no call at all in this collective (stays alive)."""
    if comm.rank == 2:
        return None
    return await comm.all_reduce(xs[comm.rank])


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda c: c.all_reduce(np.arange(4), "avg"), "floating dtype"),
        (lambda c: c.all_reduce(np.ones(4, dtype=np.complex64), "max"), "not defined"),
        (lambda c: c.all_reduce(np.ones(4), "bxor"), "bitwise: it needs an integer or bool"),
        (lambda c: c.all_reduce(np.array(["a", "b"])), "not supported"),
        (lambda c: c.all_reduce(np.ones(3), "median"), "unknown reduce op"),
        (lambda c: c.all_reduce(np.ones(3), algorithm="butterfly"), "unknown all_reduce"),
        (lambda c: c.broadcast(np.ones(3), root=5), "root=5"),
        (lambda c: c.reduce(np.ones(3), root=-1), "root=-1"),
        (lambda c: c.all_reduce([1.0, 2.0]), "must be a numpy array"),
        (lambda c: c.all_reduce(np.ones(3), timeout=-1), "timeout"),
        (lambda c: c.send(np.ones(3), dst=c.rank), "that is this rank, which cannot send to"),
        (lambda c: c.recv(src=9), r"must be another rank of this group \(ranks are 0\.\.2\)"),
    ],
)
async def test_invalid_input_raises_config_error_on_every_rank_before_sending(bad, message):
    async with open_local_cluster(3, config=PATIENT) as cluster:
        for comm in cluster:
            with pytest.raises(ConfigError, match=message):
                bad(comm)
        assert all(c.statistics()["in_flight"] == 0 for c in cluster)
        await assert_still_usable(cluster)


async def test_read_only_output_is_refused_before_anything_is_sent():
    async with open_local_cluster(2, config=PATIENT) as cluster:
        x = np.ones(4)
        x.flags.writeable = False
        for comm in cluster:
            with pytest.raises(ConfigError, match="read-only"):
                comm.all_reduce(x)
        await assert_still_usable(cluster)


async def test_invalid_input_on_one_rank_fails_its_peers_fast():
    async with open_local_cluster(3, config=PATIENT) as cluster:
        with pytest.raises(ConfigError, match="floating"):
            cluster[0].all_reduce(np.arange(4), "avg")
        results = await asyncio.gather(
            cluster[1].all_reduce(np.arange(4)),
            cluster[2].all_reduce(np.arange(4)),
            return_exceptions=True,
        )
        assert_all(results, CollectiveMismatchError, "rank 0", "op=avg", "op=sum")
        await assert_still_usable(cluster)


async def test_cancelling_a_call_on_one_rank_aborts_it_on_the_others():
    async with open_local_cluster(3, config=PATIENT) as cluster:
        handles = [c.all_reduce(np.ones(100)) for c in cluster[:2]]  # rank 2 never calls
        handles[0].cancel()
        with pytest.raises(asyncio.CancelledError):
            await handles[0]
        with pytest.raises(CollectiveAbortedError, match="rank 0 cancelled"):
            await handles[1]
        late = cluster[2].all_reduce(np.ones(100))
        with pytest.raises(CollectiveAbortedError):
            await late


async def test_errors_carry_structured_facts():
    async with open_local_cluster(2, config=PATIENT) as cluster:
        results = await outcomes(cluster, lambda c: c.all_reduce(np.ones(2 + c.rank)))
        for rank, error in enumerate(results):
            assert isinstance(error, dsml.CollectiveError)
            assert error.rank == rank
            assert error.collective == "all_reduce"
            assert error.epoch == cluster[rank].epoch
            assert set(error.ranks) == {0, 1}


async def test_a_handle_reports_its_state():
    async with open_local_cluster(2) as cluster:
        handles = [c.all_reduce(np.ones(3)) for c in cluster]
        assert "running" in repr(handles[0]) or "done" in repr(handles[0])
        await asyncio.gather(*handles)
        assert handles[0].done()
        assert "done" in repr(handles[0])
        assert handles[0].result() is not None


async def test_a_peer_told_of_rejected_gather_arguments_hears_only_what_differs():
    """Rank 1's gather of an object array is rejected; rank 0's error names the dtype, and
    not also a shape that differed only because the rejected call's row shape was wrong."""
    async with open_local_cluster(2) as cluster:

        async def call(comm):
            x = np.zeros(100, dtype=object if comm.rank == 1 else np.float64)
            with pytest.raises(dsml.DsmlError) as failed:
                await comm.gather(x)
            return str(failed.value)

        messages = await cluster.run(call)
    assert "(different dtype)" in messages[0], messages[0]
    assert "gather(object, shape=(*)" in messages[0]
    assert "dtype object is not supported" in messages[1]


async def test_a_call_in_flight_when_its_communicator_closes_fails_with_a_typed_error():
    """It ended in a bare CancelledError, which the awaiting task would take for its own
    cancellation (a TaskGroup, asyncio.timeout)."""
    async with open_local_cluster(2, config=dsml.CommConfig(timeout=10)) as cluster:
        handle = cluster[0].all_reduce(np.ones(4))
        await asyncio.sleep(0.05)  # rank 1 never calls: it waits
        await cluster[0].aclose()
        with pytest.raises(dsml.CollectiveAbortedError, match="closed while the call ran"):
            await handle
        with pytest.raises(dsml.CollectiveAbortedError):  # again: the same answer
            await handle
        assert isinstance(handle.exception(), dsml.CollectiveAbortedError)
        # a caller's own cancel still gives CancelledError
        h2 = cluster[1].all_reduce(np.ones(4))
        await asyncio.sleep(0)
        h2.cancel()
        with pytest.raises(asyncio.CancelledError):
            await h2


async def test_a_call_the_caller_cancelled_just_before_close_stays_a_cancellation():
    async with open_local_cluster(2, config=dsml.CommConfig(timeout=10)) as cluster:
        handle = cluster[0].all_reduce(np.ones(4))
        await asyncio.sleep(0.05)
        handle.cancel()
        await cluster[0].aclose()  # in the same tick: it must not relabel the cancel
        with pytest.raises(asyncio.CancelledError):
            await handle
