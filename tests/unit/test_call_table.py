"""The call table and failure delivery, without sockets: failures arrive as values."""

from __future__ import annotations

import asyncio

import pytest

from dsml.collectives.group import Lane
from dsml.communicator.call import Call, DeadlinePassed
from dsml.communicator.call_table import PEER_LEFT, CallTable
from dsml.communicator.diagnose import abort_body
from dsml.errors import (
    CollectiveAbortedError,
    CollectiveMismatchError,
    MemberLeftError,
    PeerLostError,
)
from dsml.wire import Envelope, Fingerprint, Kind

from .fakes import FakeLinks, view

FP = Fingerprint("all_reduce", dtype="int64", count=4, shape=(4,), op="sum", algorithm="ring")


def table_at(epoch: int = 1, *ids: int) -> tuple[CallTable, FakeLinks]:
    links = FakeLinks()
    table = CallTable(links, links.config)  # type: ignore[arg-type]
    v = view(epoch, *(ids or (0, 1, 2)))
    table.enter(v)
    links.enter(v)
    return table, links


def open_call(table: CallTable, fp: Fingerprint = FP) -> Call:
    call = Call(table, table.take_cid(), fp, 10.0)
    table.register(call)
    return call


def chunk(epoch: int, src: int, cid: int, fp: Fingerprint = FP) -> Envelope:
    return Envelope(Kind.CHUNK, epoch, src, cid, 0, 0, fingerprint=fp)


async def test_collective_ids_are_taken_in_order_and_start_again_in_a_new_view():
    table, _links = table_at()
    assert [table.take_cid() for _ in range(3)] == [1, 2, 3]
    table.enter(view(2, 0, 1))
    assert table.take_cid() == 1


async def test_a_failure_reaches_a_waiting_receive_as_its_error_not_as_a_cancellation():
    table, _links = table_at()
    call = open_call(table)
    waiting = asyncio.ensure_future(call.recv(1, 0))
    await asyncio.sleep(0)
    error = PeerLostError("rank 1 died", lost=[1])
    assert call.fail(error) is True
    assert call.fail(PeerLostError("second")) is False  # the first failure wins
    with pytest.raises(PeerLostError, match="rank 1 died"):
        await waiting
    assert not waiting.cancelled()


async def test_a_message_that_arrived_first_is_delivered_to_a_later_receive():
    table, _links = table_at()
    call = open_call(table)
    table.handle_chunk(1, chunk(1, 1, call.cid), [memoryview(b"abcd")])
    received = await call.recv(1, 0, nbytes=4, lane=Lane.DATA)
    assert bytes(received.payload) == b"abcd"


async def test_a_mismatched_fingerprint_fails_the_call_and_aborts_the_peers():
    table, links = table_at()
    call = open_call(table)
    other = Fingerprint("broadcast", dtype="int64", count=4, shape=(4,), root=0)
    table.handle_chunk(2, chunk(1, 2, call.cid, other), [])
    assert isinstance(call.failure, CollectiveMismatchError)
    assert "ABORT" in links.kinds()
    with pytest.raises(CollectiveMismatchError):
        await call.recv(2, 0)


async def test_an_abort_for_a_call_not_made_yet_fails_it_when_it_is_made():
    table, _links = table_at()
    body = abort_body("failed", "rank 1 failed: boom", 1)
    table.handle_abort(1, Envelope(Kind.ABORT, 1, 1, 1, fingerprint=FP, body=body), [])
    call = open_call(table)
    assert isinstance(call.failure, CollectiveAbortedError)
    assert "boom" in str(call.failure)


async def test_a_goodbye_fails_later_calls_only_and_ends_receives_from_that_peer():
    table, _links = table_at()
    first, second = open_call(table), open_call(table)
    receive = Call(table, 0, Fingerprint("recv"), 10.0, peer=1, tag=7)
    table.add_receive(receive)
    table.handle_goodbye(1, Envelope(Kind.GOODBYE, 1, 1, body={"last": 1}), [])
    assert first.failure is None
    assert isinstance(second.failure, MemberLeftError)
    env, _ = await table.mailbox.get(("p2p", 1), (1, 7))
    assert env is PEER_LEFT


async def test_fail_all_fails_calls_above_the_limit_and_every_receive():
    table, _links = table_at()
    calls = [open_call(table) for _ in range(3)]
    receive = Call(table, 0, Fingerprint("recv"), 10.0, peer=2, tag=0)
    table.add_receive(receive)
    failed = table.fail_all(lambda c: PeerLostError(f"#{c.cid}"), after=1)
    assert failed == 3
    assert calls[0].failure is None
    assert [str(c.failure) for c in calls[1:]] == ["#2", "#3"]
    assert receive.failure is not None


async def test_messages_for_finished_calls_and_old_epochs_are_counted_not_kept():
    table, _links = table_at()
    call = open_call(table)
    table.finish(call)
    table.handle_chunk(1, chunk(1, 1, call.cid), [])
    assert table.counters["late"] == 1
    later = open_call(table)
    table.handle_chunk(1, chunk(1, 1, later.cid), [])
    table.enter(view(2, 0, 1))
    assert table.counters["stale"] == 1
    assert len(table.mailbox) == 0


async def test_a_deadline_is_delivered_like_any_other_failure():
    table, _links = table_at()
    call = open_call(table)
    loop = asyncio.get_running_loop()
    loop.call_later(0.01, call.fail, DeadlinePassed())
    with pytest.raises(DeadlinePassed):
        await call.recv(1, 0)
