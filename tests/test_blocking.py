"""dsml.blocking: the collectives from synchronous code, on a loop thread of their own.

In-process tests run one blocking communicator per thread against a registry on its own
loop thread; the training loop and Ctrl-C run in real processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dsml
import dsml.blocking
from dsml.blocking import BlockingCommunicator, LoopThread

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"


@contextlib.contextmanager
def registry() -> Iterator[str]:
    """A registry on a loop thread of its own; yields its address."""
    loop = LoopThread("test-registry")
    reg = loop.run(dsml.open_registry("tcp://127.0.0.1:0"), "open_registry")
    try:
        yield reg.address
    finally:
        loop.run(reg.aclose(), "close registry")
        loop.stop()


def on_ranks(world_size: int, body: Callable[[BlockingCommunicator], Any]) -> list[Any]:
    """body(comm) on world_size threads, each with its own blocking communicator."""
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []
    with registry() as address:

        def rank(r: int) -> None:
            try:
                with dsml.blocking.init(address, world_size, rank=r, timeout=30) as comm:
                    results[r] = body(comm)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return results


def test_blocking_collectives_return_results_and_reduce_in_place():
    def body(comm: BlockingCommunicator) -> dict[str, Any]:
        x = np.arange(4.0) * (comm.rank + 1)
        out = {"all_reduce_is_x": comm.all_reduce(x) is x, "x": x.tolist()}
        out["gather"] = comm.all_gather(np.array([comm.rank]))
        out["scatter"] = comm.scatter(np.arange(6) if comm.rank == 0 else None, 0)
        comm.barrier()
        return out

    results = on_ranks(3, body)
    for rank, out in enumerate(results):
        assert out["all_reduce_is_x"]
        assert out["x"] == [0.0, 6.0, 12.0, 18.0]
        assert out["gather"].tolist() == [0, 1, 2]
        assert out["scatter"].tolist() == np.array_split(np.arange(6), 3)[rank].tolist()


def test_sub_communicators_stats_and_traces_are_there_as_in_the_async_api(tmp_path: Path):
    def body(comm: BlockingCommunicator) -> dict[str, Any]:
        views: list[Any] = []
        remove = comm.on_view_change(lambda old, new: views.append(new))
        halves = comm.split(comm.rank % 2, key=-comm.rank)
        assert halves is not None
        x = np.full(2, float(comm.rank))
        halves.all_reduce(x)
        pair = comm.new_group([0, 1])
        if pair is not None:
            pair.barrier()
            pair.close()  # leaves the pair; the parent's loop thread keeps running
        halves.close()
        comm.all_reduce(np.ones(1))  # the parent still works
        remove()
        path = tmp_path / f"trace{comm.rank}.json"
        comm.write_trace(path)
        return {
            "x": x.tolist(),
            "sub_rank": halves.rank,
            "kinds": [record["kind"] for record in comm.stats()],
            "trace": "traceEvents" in comm.trace() and path.stat().st_size > 0,
            "choice": comm.all_reduce_choice(1 << 20).algorithm,
            "paired": pair is not None,
            "views": views,
        }

    results = on_ranks(4, body)
    for rank, out in enumerate(results):
        assert out["x"] == [2.0, 2.0] if rank % 2 == 0 else [4.0, 4.0]
        assert out["sub_rank"] == (1 - rank // 2)  # key=-rank: the higher rank first
        assert out["kinds"][-1] == "all_reduce"
        assert out["trace"]
        assert isinstance(out["choice"], str)
        assert out["paired"] == (rank < 2)
        assert out["views"] == []  # no member came or went


def test_a_blocking_init_that_blocks_the_loop_serving_the_registry_says_so():
    async def in_a_cell() -> None:  # a notebook cell: the kernel's loop serves the registry
        async with dsml.open_registry("tcp://127.0.0.1:0") as reg:
            with pytest.raises(dsml.RegistryUnavailableError, match=r"await dsml\.init"):
                dsml.blocking.init(
                    reg.address, 1, config=dsml.CommConfig(join_timeout=1.0, registry_timeout=1.0)
                )

    asyncio.run(in_a_cell())


def test_async_op_gives_a_handle_that_waits_and_says_when_it_is_done():
    def body(comm: BlockingCommunicator) -> list[float]:
        xs = [np.full(3, float(comm.rank + i)) for i in range(4)]
        handles = [comm.all_reduce(x, async_op=True) for x in xs]
        results = [h.wait(timeout=30) for h in handles]
        assert all(h.done() for h in handles)
        assert all(r is x for r, x in zip(results, xs, strict=True))
        return [float(x[0]) for x in xs]

    assert on_ranks(2, body) == [[1.0, 3.0, 5.0, 7.0]] * 2


def test_waiting_on_a_handle_with_a_timeout_leaves_the_call_running():
    def body(comm: BlockingCommunicator) -> str:
        if comm.rank == 0:
            h = comm.all_reduce(np.ones(2), async_op=True)
            with pytest.raises(TimeoutError, match="still running"):
                h.wait(timeout=0.05)  # rank 1 has not called yet
            assert not h.done()
            comm.send(np.zeros(1), 1)  # now rank 1 calls
            return str(h.wait(timeout=30).tolist())
        comm.recv(0)
        return str(comm.all_reduce(np.ones(2)).tolist())

    assert on_ranks(2, body) == ["[2.0, 2.0]"] * 2


def test_errors_raise_in_the_calling_thread_with_their_type():
    def body(comm: BlockingCommunicator) -> None:
        with pytest.raises(dsml.ConfigError, match="floating"):
            comm.all_reduce(np.arange(3), "avg")
        with pytest.raises(dsml.CollectiveMismatchError):
            comm.all_reduce(np.ones(2 + comm.rank))
        comm.barrier()

    on_ranks(2, body)


def test_the_engine_is_usable_from_a_blocking_communicator():
    def body(comm: BlockingCommunicator) -> list[float]:
        engine = comm.engine
        grad = engine.tag("grad", np.zeros(3))
        engine.push(lambda: grad.data.__iadd__(comm.rank + 1), mutate=[grad.var])
        reduced = comm.engine.push_all_reduce(grad)
        scaled = engine.push(lambda: grad.data.__imul__(10), mutate=[grad.var])
        engine.wait_var(grad.var)
        engine.wait_all()
        assert reduced.done()
        assert scaled.done()
        return grad.data.tolist()

    assert on_ranks(2, body) == [[30.0, 30.0, 30.0]] * 2


def test_collectives_work_from_a_thread_whose_own_event_loop_is_running():
    """As in a Jupyter cell, or code called from a coroutine: the call blocks that loop
    (it was refused as 'belongs to another event loop')."""

    def body(comm: BlockingCommunicator) -> list[float]:
        async def cell() -> list[float]:
            x = comm.all_reduce(np.full(3, float(comm.rank + 1)))
            comm.barrier()
            handle = comm.all_reduce(np.ones(2), async_op=True)
            return [*x.tolist(), *handle.wait(timeout=30).tolist()]

        return asyncio.run(cell())

    assert on_ranks(2, body) == [[3.0, 3.0, 3.0, 2.0, 2.0]] * 2


def test_blocking_calls_from_a_coroutine_op_on_the_loop_thread_do_not_deadlock():
    def body(comm: BlockingCommunicator) -> list[float]:
        engine = comm.engine
        seen: list[Any] = []

        async def op() -> None:  # runs on the communicator's own loop thread
            seen.append(comm.all_reduce(np.ones(2), async_op=True))
            pushed = engine.push(lambda: None)
            seen.append(pushed.cancel() in (True, False))  # answered at once, no wait

        engine.push(op).wait(timeout=30)
        assert seen[1] is True
        return list(seen[0].wait(timeout=30).tolist())

    assert on_ranks(2, body) == [[2.0, 2.0]] * 2


def test_cancelling_a_blocking_engine_op_cancels_it_in_the_engine():
    def body(comm: BlockingCommunicator) -> str:
        engine = comm.engine
        v = engine.new_var("v")
        gate = threading.Event()
        engine.push(gate.wait, mutate=[v])  # a pool thread, until released
        ran: list[int] = []
        later = engine.push(lambda: ran.append(1), mutate=[v])
        assert later.cancel()  # pending: removed, never runs (it only stopped waiting)
        gate.set()
        engine.wait_all()
        assert ran == []
        failed = engine.push(lambda: 1 / 0, mutate=[v])
        with pytest.raises(ZeroDivisionError):
            failed.wait(timeout=30)
        engine.clear_error(v)
        return str(engine.push(lambda: "ok", read=[v]).wait(timeout=30))

    assert on_ranks(1, body) == ["ok"]


def test_close_joins_the_loop_thread_and_refuses_later_calls():
    before = {t.ident for t in threading.enumerate()}

    def with_engine(comm: BlockingCommunicator) -> tuple[BlockingCommunicator, Any, Any]:
        engine = comm.engine
        v = engine.new_var("v")
        with pytest.raises(dsml.ConfigError, match="must hold vars"):
            engine.wait_var(None)  # type: ignore[arg-type]
        return comm, engine, v

    comms = on_ranks(2, with_engine)
    for comm, engine, v in comms:
        with pytest.raises(dsml.ConfigError, match="closed"):
            comm.barrier()
        # not "RuntimeError: Event loop is closed" with never-awaited coroutines
        for call in (
            lambda: engine.push(lambda: None),
            lambda: engine.wait_all(),
            lambda: engine.wait_var(v),
            lambda: comm.var,
            lambda: comm.statistics(),
        ):
            with pytest.raises(dsml.ConfigError, match="closed"):
                call()
    left = [t for t in threading.enumerate() if t.ident not in before and t.name == "dsml-loop"]
    assert left == []


def run_script(n: int, script: str, *args: str, timeout: float = 60) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "dsml", "run", "-n", str(n), str(SCRIPTS / script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


@pytest.mark.multiprocess
def test_a_synchronous_training_loop_converges_to_the_same_weights_on_every_rank():
    steps = 60
    proc = run_script(3, "blocking_sgd.py", str(steps))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    rows = [json.loads(line.split("] ", 1)[1]) for line in out.splitlines() if "{" in line]
    assert sorted(r["rank"] for r in rows) == [0, 1, 2]
    # the same descent done serially on all the data
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3 * 32, 4))
    y = x @ np.arange(1.0, 5.0)
    w = np.zeros(4)
    for _ in range(steps):
        grads = [
            2
            * x[r * 32 : (r + 1) * 32].T
            @ (x[r * 32 : (r + 1) * 32] @ w - y[r * 32 : (r + 1) * 32])
            / 32
            for r in range(3)
        ]
        w -= 0.05 * (sum(grads) / 3)
    for row in rows:
        np.testing.assert_allclose(row["w"], w, rtol=1e-12, atol=1e-12)
        assert row["w"] == rows[0]["w"]  # bitwise the same on every rank
    assert rows[0]["loss"] < 1e-2


@pytest.mark.multiprocess
def test_ctrl_c_interrupts_a_blocked_wait_and_the_communicator_stays_usable():
    with registry() as address:
        env = {**os.environ, "DSML_REGISTRY": address, "DSML_WORLD_SIZE": "2"}
        procs = [
            subprocess.Popen(
                [sys.executable, str(SCRIPTS / "blocking_interrupted.py")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                env={**env, "DSML_RANK": str(rank)},
            )
            for rank in range(2)
        ]
        try:
            blocked, peer = procs
            assert blocked.stdout.readline().strip() == "waiting", blocked.stderr.read()
            assert peer.stdout.readline().strip() == "ready", peer.stderr.read()
            # "waiting" comes once rank 0's main thread is in the wait (a thread of the
            # script looks at its stack), not after a guessed sleep
            sent = time.monotonic()
            blocked.send_signal(signal.SIGINT)
            line = blocked.stdout.readline()
            print(f"{line.strip()} (seen {time.monotonic() - sent:.3f} s after SIGINT)")
            assert line.startswith("interrupted after"), blocked.stderr.read()
            peer.stdin.write("go\n")
            peer.stdin.flush()
            outs = [p.communicate(timeout=30) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        assert blocked.returncode == 0, outs[0][1]
        assert "usable" in outs[0][0]
        assert peer.returncode == 0, outs[1][1]
        # The peer either fails the matching call (told of the cancel) or, when rank 0's
        # data had already reached it, keeps its result (see CollectiveHandle.cancel).
        peer_line = outs[1][0].splitlines()[0]
        assert peer_line in ("peer: CollectiveAbortedError", "peer: no error"), outs[1]
        assert "usable" in outs[1][0]


@pytest.mark.timeout(60)
def test_ctrl_c_taken_by_another_thread_still_interrupts_the_main_threads_wait():
    """The kernel may hand a process's SIGINT to any of its threads; one taken by the loop
    thread set Python's flag but never woke the main thread's lock wait, so Ctrl-C (and
    the test above, under load) hung until the call ended by itself."""
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "sigint_to_another_thread.py")],
        capture_output=True,
        text=True,
        timeout=50,
        cwd=ROOT,
    )
    assert result.stdout.startswith("interrupted after"), (result.stdout, result.stderr)
    assert float(result.stdout.split()[2]) < 20  # not the 30 s the sleep would take
