"""Collectives pushed through each rank's dependency engine (comm.engine, comm.var)."""

from __future__ import annotations

import asyncio
import random
import threading

import numpy as np
import pytest

from dsml import (
    CollectiveAbortedError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommConfig,
    ConfigError,
    DependencyFailedError,
)
from dsml.testing import open_local_cluster

LAYERS = 5


@pytest.mark.parametrize("world_size", [2, 3, 4])
async def test_collectives_match_by_push_order_even_when_inputs_are_ready_in_other_orders(
    world_size, seed
):
    """Each rank finishes its gradients in a different order; the collectives still pair up
    (mixed kinds, so a wrong pairing would be a mismatch, not a silent wrong sum)."""
    async with open_local_cluster(world_size, config=CommConfig(timeout=30)) as cluster:

        async def step(comm):
            engine = comm.engine
            order = list(range(LAYERS))
            random.Random(seed + comm.rank).shuffle(order)
            ready = {layer: asyncio.Event() for layer in range(LAYERS)}
            grads = [engine.tag(f"g{i}", np.zeros(10 * (i + 1))) for i in range(LAYERS)]

            def compute(i):
                async def fn():
                    await ready[i].wait()
                    grads[i].data[:] = comm.rank + i

                return fn

            for i in range(LAYERS):  # pushed in layer order ...
                engine.push(compute(i), mutate=[grads[i].var], name=f"grad{i}")
                if i % 2:
                    comm.push_all_reduce(grads[i])
                else:
                    comm.push_broadcast(grads[i], root=i % world_size)
            for i in order:  # ... but ready in a rank-specific order
                ready[i].set()
                await asyncio.sleep(0)
            await engine.wait_all()
            return [g.data for g in grads]

        results = await cluster.run(step)
        for i in range(LAYERS):
            expected = sum(r + i for r in range(world_size)) if i % 2 else i % world_size + i
            for rank in range(world_size):
                assert (results[rank][i] == expected).all(), (rank, i)


async def test_the_lecture_program_runs_with_compute_overlapping_the_all_reduce():
    async with open_local_cluster(3) as cluster:

        async def program(comm):
            engine = comm.engine
            a, b, c = (engine.tag(n, np.zeros(4)) for n in "ABC")
            in_flight = threading.Event()
            overlapped = []

            def set_a():
                a.data[:] = 2

            async def slow_all_reduce():
                in_flight.set()  # the collective has started; C may run meanwhile
                await asyncio.sleep(0.05)
                return await comm.all_reduce(b.data)

            def c_is_a_plus_1():
                overlapped.append(in_flight.wait(timeout=5))
                c.data[:] = a.data + 1

            engine.push(set_a, mutate=[a.var])
            engine.push(
                lambda: b.data.__setitem__(slice(None), a.data), read=[a.var], mutate=[b.var]
            )
            engine.push(slow_all_reduce, mutate=[b.var, comm.var])
            engine.push(c_is_a_plus_1, read=[a.var], mutate=[c.var])
            await engine.wait_all()
            return b.data.copy(), c.data.copy(), overlapped

        for b, c, overlapped in await cluster.run(program):
            assert (b == 6).all()
            assert (c == 3).all()
            assert overlapped == [True]  # C ran while the all_reduce was in flight


async def test_a_plain_function_returning_a_collective_handle_is_awaited_on_the_loop():
    async with open_local_cluster(2) as cluster:

        async def program(comm):
            g = comm.engine.tag("g", np.full(8, comm.rank + 1.0))
            comm.engine.push(lambda: comm.all_reduce(g.data), mutate=[g.var, comm.var])
            await comm.engine.wait_var(g.var)
            return g.data

        for result in await cluster.run(program):
            assert (result == 3.0).all()


async def test_a_failed_collective_poisons_its_data_var_until_cleared():
    async with open_local_cluster(2, config=CommConfig(timeout=30)) as cluster:

        async def program(comm):
            engine = comm.engine
            g = engine.tag("g", np.ones(4 + comm.rank))  # shapes differ: a mismatch
            comm.push_all_reduce(g)
            later = engine.push(lambda: None, read=[g.var], name="uses g")
            with pytest.raises(DependencyFailedError) as failed:
                await later
            assert isinstance(failed.value.__cause__, CollectiveMismatchError)
            with pytest.raises(DependencyFailedError):
                await engine.wait_var(g.var)
            await engine.wait_var(comm.var)  # issuing succeeded: later collectives go on
            engine.clear_error(g.var)
            await engine.push(lambda: None, read=[g.var])
            ok = engine.tag("ok", np.ones(3))
            await comm.push_all_reduce(ok)
            return ok.data

        for result in await cluster.run(program):
            assert (result == 2).all()


async def test_closing_the_communicator_closes_its_engine():
    async with open_local_cluster(2) as cluster:
        engines = [c.engine for c in cluster]
        assert all(c.var is c.var for c in cluster)  # one ordering var per communicator
    for engine in engines:
        assert engine.closed


async def test_a_direct_call_made_while_pushed_collectives_wait_queues_behind_them():
    """Without queueing, the direct call could take its id before the pushed one on one
    rank and after it on another, and the two would pair up silently (same shapes)."""
    async with open_local_cluster(2, config=CommConfig(timeout=30)) as cluster:

        async def program(comm):
            engine = comm.engine
            g = engine.tag("g", np.full(4, 1.0))
            ready = asyncio.Event()

            async def produce():
                await ready.wait()

            engine.push(produce, mutate=[g.var])
            comm.push_all_reduce(g)  # issued once produce() is done
            if comm.rank == 1:  # here the pushed all_reduce is issued first ...
                ready.set()
                await engine.wait_var(comm.var)  # the issue op (its id is taken)
            direct = comm.all_reduce(np.full(4, 100.0))  # ... on rank 0 the direct call is
            ready.set()
            h = await direct
            await engine.wait_all()
            return g.data.copy(), h

        for g, h in await cluster.run(program):
            assert (g == 2.0).all()  # pushed all_reduce of g
            assert (h == 200.0).all()  # direct all_reduce of h


async def test_a_rejected_issue_does_not_poison_the_order_of_later_collectives():
    async with open_local_cluster(2, config=CommConfig(timeout=30)) as cluster:

        async def program(comm):
            a = comm.engine.tag("a", np.ones(4))
            if comm.rank == 1:
                a.data.flags.writeable = False  # rejected on rank 1 only
            b = comm.engine.tag("b", np.ones(4))
            first = comm.push_all_reduce(a)
            second = comm.push_all_reduce(b)
            outcome = await asyncio.gather(first, return_exceptions=True)
            return outcome[0], await second

        (first0, b0), (first1, b1) = await cluster.run(program)
        assert isinstance(first1, ConfigError)
        assert isinstance(first0, CollectiveMismatchError | CollectiveAbortedError)
        assert (b0 == 2).all()
        assert (b1 == 2).all()


async def test_a_collective_called_inside_an_op_that_reads_comm_var_does_not_wait_for_itself():
    async with open_local_cluster(2, config=CommConfig(timeout=10)) as cluster:

        async def program(comm):
            async def inside():
                return await comm.all_reduce(np.ones(3))

            return await comm.engine.push(inside, read=[comm.var])

        for result in await cluster.run(program):
            assert (result == 2).all()


async def test_a_direct_call_inside_an_op_then_a_pushed_collective_do_not_deadlock():
    async with open_local_cluster(2, config=CommConfig(timeout=10)) as cluster:

        async def program(comm):
            engine = comm.engine
            d = engine.tag("d", np.ones(3))

            async def b():
                return await comm.all_reduce(np.full(3, 5.0))

            first = engine.push(b, mutate=[d.var])
            second = comm.push_all_reduce(d)
            return await first, await second

        for first, second in await cluster.run(program):
            assert (first == 10).all()
            assert (second == 2).all()


async def test_a_poisoned_input_on_one_rank_fails_the_collective_everywhere_and_ids_stay_in_step():
    async with open_local_cluster(2, config=CommConfig(timeout=10)) as cluster:

        async def program(comm):
            engine = comm.engine
            g = engine.tag("g", np.ones(4))

            def produce():
                if comm.rank == 0:
                    raise RuntimeError("rank 0 lost its batch")

            engine.push(produce, mutate=[g.var])
            failed = await asyncio.gather(comm.push_all_reduce(g), return_exceptions=True)
            h = engine.tag("h", np.full(4, 3.0))
            after = await comm.push_all_reduce(h)  # same shape as g: would pair silently
            return failed[0], after

        (error0, h0), (error1, h1) = await cluster.run(program)
        assert isinstance(error0, DependencyFailedError)
        assert isinstance(error1, CollectiveAbortedError)
        assert "poisoned" in str(error1)
        assert (h0 == 6).all()
        assert (h1 == 6).all()


@pytest.mark.parametrize("how", ["skipped", "failed before its collective"])
async def test_a_lecture_op_that_does_not_make_its_collective_on_one_rank_keeps_ids_in_step(how):
    """The lecture's form: an op that mutates comm.var and calls the collective. On rank 1
    it does not run (its input is poisoned), or it raises before its collective. The
    other ranks made theirs, and rank 1's ids were one behind for good: later calls of
    the same shape paired with the wrong ones, returning wrong sums without an error (a
    probe, 6/6). Rank 1 now takes the op's turn and fails it on every rank."""
    async with open_local_cluster(3, config=CommConfig(timeout=10)) as cluster:

        async def program(comm):
            engine = comm.engine
            x = engine.tag("x", np.ones(2))

            def produce():
                if comm.rank == 1 and how == "skipped":
                    raise ValueError("bad batch on rank 1")

            async def reduce_x():
                if comm.rank == 1 and how != "skipped":
                    raise ValueError("rank 1 failed before its all_reduce")
                await comm.all_reduce(x.data)

            engine.push(produce, mutate=[x.var])
            engine.push(reduce_x, mutate=[x.var, comm.var], name="reduce_x")
            failed = await asyncio.gather(engine.wait_all(), return_exceptions=True)
            sums = []
            for value in (1.0, 2.0, 3.0):  # same shape as x: a pairing off by one is silent
                z = np.full(2, value)
                await comm.all_reduce(z)
                sums.append(float(z[0]))
            return failed[0], sums

        results = await cluster.run(program)
        for rank, (error, sums) in enumerate(results):
            assert sums == [3.0, 6.0, 9.0], (rank, sums)
            if rank == 1:
                assert isinstance(error, (DependencyFailedError, ValueError)), error
            else:
                assert isinstance(error, CollectiveAbortedError), error
                assert "rank 1 could not take part" in str(error)
                assert "mutates comm.var" in str(error)


async def test_a_queued_direct_call_that_is_cancelled_is_still_given_up_on_every_rank():
    async with open_local_cluster(2, config=CommConfig(timeout=10)) as cluster:

        async def program(comm):
            engine = comm.engine
            g = engine.tag("g", np.ones(2))
            gate = asyncio.Event()

            async def produce():
                await gate.wait()

            engine.push(produce, mutate=[g.var])
            comm.push_all_reduce(g)
            queued = comm.all_reduce(np.ones(2))  # waits behind the pushed one
            if comm.rank == 0:
                queued.cancel()
            gate.set()
            outcome = await asyncio.gather(queued, return_exceptions=True)
            await engine.wait_all()
            later = await comm.all_reduce(np.full(2, 4.0))  # ids are still in step
            return outcome[0], later

        (first0, later0), (first1, later1) = await cluster.run(program)
        assert isinstance(first0, asyncio.CancelledError)
        # Rank 1 either had everything already (cancellation semantics) or was told.
        assert isinstance(first1, CollectiveAbortedError) or (first1 == 2).all()
        assert (later0 == 8).all()
        assert (later1 == 8).all()


async def test_waiting_behind_pushed_collectives_counts_against_the_timeout():
    async with open_local_cluster(1) as cluster:
        comm = cluster[0]
        g = comm.engine.tag("g", np.ones(2))
        gate = asyncio.Event()

        async def produce():
            await gate.wait()

        comm.engine.push(produce, mutate=[g.var])
        comm.push_all_reduce(g)
        with pytest.raises(CollectiveTimeoutError, match=r"pushed into comm\.engine"):
            await comm.barrier(timeout=0.2)
        gate.set()
        await comm.engine.wait_all()


async def test_a_pushed_all_reduce_reduces_the_array_an_earlier_op_put_in_its_tag():
    async with open_local_cluster(2, config=CommConfig(timeout=30)) as cluster:

        async def program(comm):
            engine = comm.engine
            g = engine.tag("g", None)  # no array yet: the op pushed first makes it

            async def produce():
                await asyncio.sleep(0.05)  # surely after push_all_reduce below was called
                g.data = np.full(4, float(comm.rank + 1))

            engine.push(produce, mutate=[g.var])
            done = comm.push_all_reduce(g)
            await engine.wait_all()
            return await done

        for result in await cluster.run(program):
            np.testing.assert_array_equal(result, np.full(4, 3.0))


async def test_cancelling_a_pushed_all_reduce_cancels_the_collective_and_holds_its_var():
    """The cancelled handle's var stays held while the collective may still use the data:
    the peer fails instead of getting a sum of data overwritten meanwhile (it did)."""
    async with open_local_cluster(2, config=CommConfig(timeout=30)) as cluster:

        async def program(comm):
            engine = comm.engine
            a = engine.tag("a", np.full(4, float(comm.rank + 1)))
            if comm.rank == 1:
                await asyncio.sleep(0.5)  # arrives late: rank 0's collective is in flight
                handle = comm.push_all_reduce(a)
                with pytest.raises(CollectiveAbortedError):
                    await handle
                return a.data.copy()
            handle = comm.push_all_reduce(a)
            assert handle.cancel()  # before its completion op could start
            seen = engine.push(lambda: a.data.copy(), read=[a.var])
            engine.push(lambda: a.data.__setitem__(slice(None), 100.0), mutate=[a.var])
            with pytest.raises(DependencyFailedError):
                await seen  # ran only once the collective had ended, behind its poison
            with pytest.raises(asyncio.CancelledError):
                await handle
            assert handle.cancelled()
            with pytest.raises(DependencyFailedError):
                await engine.wait_var(a.var)  # a cancelled op poisons its var, as documented
            engine.clear_error(a.var)
            return a.data.copy()

        results = await cluster.run(program)
        np.testing.assert_array_equal(results[1], np.full(4, 2.0))  # its input, intact
        # and the next collective pairs up on both ranks
        sums = await cluster.run(lambda c: c.all_reduce(np.ones(3)))
        for s in sums:
            np.testing.assert_array_equal(s, np.full(3, 2.0))


async def test_a_pushed_all_reduce_takes_a_torch_tensor_an_earlier_op_put_in_its_tag():
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install dsml[torch])")
    async with open_local_cluster(2, config=CommConfig(timeout=30)) as cluster:

        async def program(comm):
            engine = comm.engine
            t = engine.tag("t", torch.zeros(4))

            def replace():
                t.data = torch.full((4,), float(comm.rank + 1))

            engine.push(replace, mutate=[t.var])
            done = comm.push_all_reduce(t)
            await engine.wait_all()
            await done
            return t.data

        for _ in range(20):  # a race: replace() finishing between the push's two reads of
            # t.data reduced the old tensor (in about a third of the runs)
            for result in await cluster.run(program):
                assert torch.equal(result, torch.full((4,), 3.0))


async def test_closing_the_engine_with_cancel_cancels_a_pushed_collective_cleanly():
    """Its issue op was cancelled too: the completion op failed with an IndexError."""
    async with open_local_cluster(2, config=CommConfig(timeout=30)) as cluster:
        comm = cluster[0]
        gate = asyncio.Event()
        a = comm.engine.tag("a", np.ones(2))
        comm.engine.push(gate.wait, mutate=[a.var])  # holds a: the collective waits
        handle = comm.push_all_reduce(a)
        await comm.engine.aclose(cancel=True)
        with pytest.raises(asyncio.CancelledError):
            await handle


async def test_a_direct_call_queued_behind_pushed_ones_says_the_communicator_closed():
    """It ended in a bare CancelledError when the communicator closed with cancel."""
    async with open_local_cluster(2, config=CommConfig(timeout=30)) as cluster:
        comm = cluster[0]
        gate = asyncio.Event()
        a = comm.engine.tag("a", np.ones(2))
        comm.engine.push(gate.wait, mutate=[a.var])
        comm.push_all_reduce(a)  # waits for a, so the barrier below queues behind it
        queued = comm.barrier()
        await asyncio.sleep(0)
        await comm.aclose(cancel=True)
        with pytest.raises(CollectiveAbortedError, match="closed"):
            await queued
