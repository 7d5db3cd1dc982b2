"""The staging pipeline's order of operations, against a numpy-backed fake device.

`FakeCopies` queues copies on a fake stream that runs them only when waited for (or
drained), like a GPU that has not got round to them yet, and logs every step. That shows
what no GPU is needed to check: the wait on the caller's stream comes first, every chunk
is queued before the first is waited for, results reach the device only after the
collective succeeded, and a failure leaves the caller's array as it was.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from dsml.collectives.staging import Download, upload
from dsml.communicator.placement import staged
from dsml.communicator.plans import Plan
from dsml.wire import Fingerprint


class FakeCopies:
    """A device array (numpy) and its host twin; copies run when waited for."""

    def __init__(self, device: np.ndarray, host: np.ndarray) -> None:
        self.device, self.host = device, host
        self.log: list[str] = []
        self._queue: list[tuple[str, int, int]] = []
        self._done = 0

    def after_caller(self) -> None:
        self.log.append("after_caller")

    def _enqueue(self, kind: str, lo: int, hi: int) -> int:
        self.log.append(f"queue {kind} {lo}:{hi}")
        self._queue.append((kind, lo, hi))
        return len(self._queue)

    def to_host(self, lo: int, hi: int) -> int:
        return self._enqueue("D2H", lo, hi)

    def to_device(self, lo: int, hi: int) -> int:
        return self._enqueue("H2D", lo, hi)

    def commit(self) -> int:
        return self._enqueue("commit", 0, 0)

    def _run_one(self) -> None:
        kind, lo, hi = self._queue[self._done]
        if kind == "D2H":
            self.host[lo:hi] = self.device[lo:hi]
        elif kind == "H2D":
            self.device[lo:hi] = self.host[lo:hi]
        self.log.append(f"done {kind} {lo}:{hi}")
        self._done += 1

    async def wait(self, token: object) -> None:
        self.log.append(f"wait {token}")
        while self._done < int(token):  # type: ignore[call-overload]
            await asyncio.sleep(0)  # the "GPU" runs one copy per loop turn
            self._run_one()

    def drain(self) -> None:
        self.log.append("drain")
        while self._done < len(self._queue):
            self._run_one()


def _index(log: list[str], prefix: str, last: bool = False) -> int:
    hits = [i for i, line in enumerate(log) if line.startswith(prefix)]
    return hits[-1] if last else hits[0]


async def test_download_waits_for_the_caller_then_queues_every_chunk_before_waiting():
    device = np.arange(10, dtype=np.float32)
    copies = FakeCopies(device, np.zeros(10, dtype=np.float32))
    download = Download(copies, 10, chunk_elems=4)
    assert copies.log == ["after_caller", "queue D2H 0:4", "queue D2H 4:8", "queue D2H 8:10"]
    assert await download.next_chunk() == (0, 4)
    assert copies.log[-1] == "done D2H 0:4"  # chunk 0 is usable while 1 and 2 are queued
    assert download.arrived == 1
    await download.wait()
    assert await download.next_chunk() is None
    np.testing.assert_array_equal(copies.host, device)


async def test_upload_queues_every_chunk_and_the_commit_before_the_first_wait():
    copies = FakeCopies(np.zeros(9, dtype=np.int64), np.arange(9, dtype=np.int64))
    await upload(copies, 9, chunk_elems=4)
    first_wait = _index(copies.log, "wait")
    assert _index(copies.log, "queue commit") < first_wait
    assert [line for line in copies.log[:first_wait] if line.startswith("queue")] == [
        "queue H2D 0:4",
        "queue H2D 4:8",
        "queue H2D 8:9",
        "queue commit 0:0",
    ]
    np.testing.assert_array_equal(copies.device, np.arange(9))


def _staged(copies: FakeCopies, body, **options) -> Plan:
    async def new_array(result: np.ndarray) -> tuple[str, np.ndarray]:
        return ("on device", result)

    inner = Plan(Fingerprint("all_reduce", "float64", 8, (8,)), body)
    defaults = {"chunk": 3, "needs_input": True, "writes_back": True, "new_array": new_array}
    return staged(inner, "the device array", copies.host, copies, **{**defaults, **options})


async def test_an_in_place_result_reaches_the_device_only_after_the_collective():
    copies = FakeCopies(np.arange(8, dtype=np.float64), np.zeros(8))
    seen_by_algorithm = []

    async def body(_call):
        seen_by_algorithm.append(copies.host.copy())
        copies.log.append("algorithm")
        copies.host *= 2
        return copies.host

    plan = _staged(copies, body)
    assert plan.fingerprint.describe() == Fingerprint("all_reduce", "float64", 8, (8,)).describe()
    assert copies.log[-1] == "queue D2H 6:8"  # queued at call time, before the body runs
    assert await plan.body(None) == "the device array"
    np.testing.assert_array_equal(seen_by_algorithm[0], np.arange(8))  # the whole input
    assert _index(copies.log, "done D2H", last=True) < _index(copies.log, "algorithm")
    assert _index(copies.log, "algorithm") < _index(copies.log, "queue H2D")
    np.testing.assert_array_equal(copies.device, np.arange(8) * 2)


async def test_a_failed_collective_never_touches_the_device_array():
    device = np.arange(8, dtype=np.float64)
    copies = FakeCopies(device, np.zeros(8))

    async def body(_call):
        copies.host[:] = -1  # a half-done result in the twin
        raise RuntimeError("peer lost")

    with pytest.raises(RuntimeError, match="peer lost"):
        await _staged(copies, body).body(None)
    assert not any("H2D" in line for line in copies.log)
    np.testing.assert_array_equal(device, np.arange(8))


async def test_a_call_cancelled_during_its_download_drains_the_copies_before_failing():
    copies = FakeCopies(np.arange(8, dtype=np.float64), np.zeros(8))
    ran = asyncio.Event()

    async def body(_call):
        ran.set()

    task = asyncio.ensure_future(_staged(copies, body, chunk=1).body(None))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not ran.is_set()
    assert copies.log[-1] == "done D2H 7:8"  # drained: nothing writes into the twin later
    assert "drain" in copies.log


async def test_a_caller_cancelling_during_the_upload_still_gets_a_whole_result():
    copies = FakeCopies(np.zeros(8), np.zeros(8))

    async def body(_call):
        copies.host[:] = 7
        return copies.host

    task = asyncio.ensure_future(_staged(copies, body, needs_input=False, chunk=2).body(None))
    while not any(line.startswith("wait") for line in copies.log):  # noqa: ASYNC110
        await asyncio.sleep(0)  # the fake has no event to wait on
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    copies.drain()  # the GPU finishes what was queued, whoever waits for it
    np.testing.assert_array_equal(copies.device, np.full(8, 7.0))


async def test_new_arrays_go_to_the_device_and_none_stays_none():
    copies = FakeCopies(np.arange(8, dtype=np.float64), np.zeros(8))

    async def gathered(_call):
        return np.ones(3)

    async def nothing(_call):
        return None

    kind, value = await _staged(copies, gathered).body(None)
    assert kind == "on device"
    np.testing.assert_array_equal(value, np.ones(3))
    assert await _staged(copies, nothing).body(None) is None
    assert not any("H2D" in line for line in copies.log)


async def test_a_broadcast_root_neither_waits_for_nothing_nor_rewrites_its_input():
    receiver = FakeCopies(np.zeros(4), np.zeros(4))

    async def receive(_call):
        receiver.host[:] = 5
        return receiver.host

    await _staged(receiver, receive, needs_input=False).body(None)
    assert not any("D2H" in line for line in receiver.log)  # nothing to download
    root = FakeCopies(np.arange(4.0), np.zeros(4))

    async def send(_call):
        return root.host

    await _staged(root, send, writes_back=False).body(None)
    assert not any("H2D" in line for line in root.log)
