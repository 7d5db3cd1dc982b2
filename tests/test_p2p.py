"""Point-to-point send and recv between the ranks of an in-process cluster."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

import dsml
from dsml import (
    CollectiveAbortedError,
    CollectiveError,
    CollectiveTimeoutError,
    CommConfig,
    ConfigError,
    MemberLeftError,
)
from dsml.testing import open_local_cluster
from dsml.wire import Envelope, Kind

from .reference import DTYPE_NAMES, dtype
from .waiting import eventually

PATIENT = CommConfig(timeout=30)
SMALL_FRAMES = CommConfig(timeout=30, chunk_bytes=1 << 20, max_frame_bytes=1 << 20)


def assert_same_array(received: np.ndarray, sent: np.ndarray) -> None:
    assert received.dtype == sent.dtype
    assert received.shape == sent.shape
    assert received.tobytes() == np.ascontiguousarray(sent).tobytes()


async def test_messages_are_ordered_per_source_destination_and_tag():
    async with open_local_cluster(3, config=PATIENT) as cluster:
        tags = [0, 1, 0, 2, 1, 0, 2, 2, 1, 0]
        sends = [
            cluster[src].send(np.array([src, i, tag]), 2, tag=tag)
            for i, tag in enumerate(tags)
            for src in (0, 1)
        ]
        # Receive tag by tag, in an order unlike the send order.
        got = {
            (src, tag): [await cluster[2].recv(src, tag=tag) for _ in range(tags.count(tag))]
            for tag in (2, 0, 1)
            for src in (1, 0)
        }
        await asyncio.gather(*sends)
        for (src, tag), arrays in got.items():
            expected = [[src, i, tag] for i, t in enumerate(tags) if t == tag]
            assert [a.tolist() for a in arrays] == expected


async def test_sends_in_both_directions_do_not_interfere():
    async with open_local_cluster(2, config=PATIENT) as cluster:

        async def exchange(comm):
            peer = 1 - comm.rank
            sends = [comm.send(np.full(4, comm.rank * 100 + i), peer) for i in range(5)]
            received = [await comm.recv(peer) for _ in range(5)]
            await asyncio.gather(*sends)
            return [int(r[0]) for r in received]

        assert await cluster.run(exchange) == [[100, 101, 102, 103, 104], [0, 1, 2, 3, 4]]


async def test_a_recv_posted_before_the_send_gets_the_message():
    async with open_local_cluster(2, config=PATIENT) as cluster:
        pending = cluster[1].recv(0, tag=7)
        await asyncio.sleep(0)  # the recv is running and waiting
        assert not pending.done()
        x = np.arange(10.0)
        await cluster[0].send(x, 1, tag=7)
        assert_same_array(await pending, x)


async def test_a_recv_posted_after_the_send_gets_the_message():
    async with open_local_cluster(2, config=PATIENT) as cluster:
        x = np.arange(10.0)
        await cluster[0].send(x, 1, tag=7)
        assert_same_array(await cluster[1].recv(0, tag=7), x)


@pytest.mark.parametrize("nbytes", [3 << 20, (3 << 20) + 12, (1 << 20) - 4])
async def test_an_array_larger_than_a_frame_arrives_exactly(nbytes):
    async with open_local_cluster(2, config=SMALL_FRAMES) as cluster:
        x = np.random.default_rng(nbytes).integers(-(2**31), 2**31, nbytes // 4, dtype=np.int32)
        received, _ = await asyncio.gather(cluster[1].recv(0), cluster[0].send(x, 1))
        assert_same_array(received, x)


async def test_an_array_too_large_for_one_message_is_refused_before_sending():
    tiny_frames = CommConfig(chunk_bytes=4096, max_frame_bytes=4096)
    async with open_local_cluster(2, config=tiny_frames) as cluster:
        with pytest.raises(ConfigError, match="more than one message may carry"):
            cluster[0].send(np.zeros(4096 * 4096 + 1, dtype=np.uint8), 1)  # 4097 frames
        with pytest.raises(CollectiveAbortedError, match="more than one message may carry"):
            await cluster[1].recv(0)  # the refusal took that send's place
        x = np.zeros(4096 * 4096, dtype=np.uint8)  # 4096 frames: the most allowed
        received, _ = await asyncio.gather(cluster[1].recv(0), cluster[0].send(x, 1))
        assert_same_array(received, x)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: np.arange(40.0).reshape(5, 8)[:, ::3], id="strided"),
        pytest.param(lambda: np.arange(24).reshape(2, 3, 4).transpose(2, 0, 1), id="transposed"),
        pytest.param(lambda: np.arange(12, dtype=">i4").reshape(3, 4), id="big-endian"),
        pytest.param(lambda: np.asfortranarray(np.arange(12.0).reshape(3, 4)), id="fortran"),
    ],
)
async def test_a_non_contiguous_array_arrives_as_a_contiguous_copy_with_the_same_values(make):
    async with open_local_cluster(2, config=PATIENT) as cluster:
        x = make()
        received, _ = await asyncio.gather(cluster[1].recv(0), cluster[0].send(x, 1))
        assert received.shape == x.shape
        assert received.dtype == x.dtype.newbyteorder("=")
        assert received.flags.c_contiguous
        np.testing.assert_array_equal(received, x)


@pytest.mark.parametrize("name", DTYPE_NAMES)
async def test_every_dtype_round_trips(name):
    async with open_local_cluster(2, config=PATIENT) as cluster:
        x = (np.arange(24) % 7).astype(dtype(name)).reshape(4, 6)
        if name.startswith("complex"):
            x = x - 1j * x
        received, _ = await asyncio.gather(cluster[1].recv(0), cluster[0].send(x, 1))
        assert_same_array(received, x)


@pytest.mark.parametrize(
    "x",
    [
        pytest.param(np.zeros(0, dtype=np.float32), id="empty"),
        pytest.param(np.zeros((0, 3), dtype=np.int16), id="empty 2-d"),
        pytest.param(np.zeros((4, 0, 2), dtype=np.complex64), id="empty 3-d"),
        pytest.param(np.array(2.5), id="0-d"),
        pytest.param(np.array(7, dtype=np.uint8), id="0-d uint8"),
    ],
)
async def test_zero_size_and_zero_dimensional_arrays_keep_their_shape(x):
    async with open_local_cluster(2, config=PATIENT) as cluster:
        received, _ = await asyncio.gather(cluster[1].recv(0), cluster[0].send(x, 1))
        assert_same_array(received, x)


@pytest.mark.parametrize("count", [10, 300_000], ids=["one small frame", "several frames"])
async def test_the_received_array_is_writable(count):
    config = CommConfig(timeout=30, chunk_bytes=1 << 18, max_frame_bytes=1 << 18)
    async with open_local_cluster(2, config=config) as cluster:
        x = np.arange(count, dtype=np.float32)
        received, _ = await asyncio.gather(cluster[1].recv(0), cluster[0].send(x, 1))
        assert received.flags.writeable
        received += 1
        np.testing.assert_array_equal(received, x + 1)


async def test_recv_with_nothing_sent_times_out_naming_the_source_rank():
    async with open_local_cluster(3, config=PATIENT) as cluster:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(CollectiveTimeoutError) as timed_out:
            await cluster[0].recv(2, tag=5, timeout=0.3)
        assert 0.3 <= loop.time() - started < 3
        message = str(timed_out.value)
        assert "recv from rank 2 (tag 5)" in message
        assert "0.3 s" in message
        assert "send(x, 0, tag=5)" in message
        assert timed_out.value.missing == (2,)
        assert timed_out.value.rank == 0
        # The sequence number was used up by the failed recv: the next send and recv pair up.
        x = np.arange(3)
        received, _ = await asyncio.gather(cluster[0].recv(2, tag=6), cluster[2].send(x, 0, tag=6))
        assert_same_array(received, x)


async def test_a_recv_that_timed_out_does_not_break_later_receives_on_its_tag():
    async with open_local_cluster(2, config=PATIENT) as cluster:
        with pytest.raises(CollectiveTimeoutError):
            await cluster[0].recv(1, tag=4, timeout=0.2)
        xs = [np.arange(3), np.arange(4), np.arange(5)]
        for x in xs:
            await cluster[1].send(x, 0, tag=4)
        for x in xs:  # the abandoned recv took nothing: the stream starts at the first send
            assert_same_array(await cluster[0].recv(1, tag=4, timeout=5), x)


async def test_two_recvs_posted_on_the_same_source_and_tag_get_the_messages_in_order():
    async with open_local_cluster(2, config=PATIENT) as cluster:
        first, second = cluster[0].recv(1, tag=2), cluster[0].recv(1, tag=2)
        await asyncio.sleep(0)  # both are running and waiting
        xs = [np.arange(3), np.arange(4)]
        for x in xs:
            await cluster[1].send(x, 0, tag=2)
        outcomes = await asyncio.gather(first, second, return_exceptions=True)
        for x, outcome in zip(xs, outcomes, strict=True):
            assert isinstance(outcome, np.ndarray), repr(outcome)
            assert_same_array(outcome, x)


async def test_recv_from_a_rank_that_closed_fails_instead_of_hanging():
    async with open_local_cluster(3, config=PATIENT) as cluster:
        pending = cluster[0].recv(1)
        await asyncio.sleep(0)  # the recv is running and waiting
        await cluster[1].aclose()
        # A graceful leave: MemberLeftError, as collectives give (it was an abort, which
        # dsml.elastic does not recover from); or, once the view has moved on, no rank 1.
        with pytest.raises((MemberLeftError, ConfigError), match="rank 1") as failed:
            await pending
        assert "closed its communicator" in str(failed.value)
        if isinstance(failed.value, MemberLeftError):
            assert failed.value.left == (1,)
        with pytest.raises((MemberLeftError, ConfigError), match="rank 1 closed its"):
            await cluster[0].recv(1, tag=3)
        # Ranks still open keep talking.
        x = np.arange(5)
        received, _ = await asyncio.gather(cluster[0].recv(2), cluster[2].send(x, 0))
        assert_same_array(received, x)


async def test_closing_a_communicator_ends_its_own_pending_recv():
    async with open_local_cluster(2, config=PATIENT) as cluster:
        pending = cluster[0].recv(1)
        await asyncio.sleep(0)  # the recv is running and waiting
        try:
            await cluster[0].aclose()
            with pytest.raises((asyncio.CancelledError, CollectiveError, ConfigError)) as ended:
                async with asyncio.timeout(2):  # far below the 30 s collective timeout
                    await pending
            assert not isinstance(ended.value, CollectiveTimeoutError)
        finally:
            pending.cancel()  # a recv that outlived its communicator must not leak
            with contextlib.suppress(BaseException):
                await pending


@pytest.mark.parametrize("recv_first", [True, False], ids=["recv posted", "recv after close"])
async def test_a_message_sent_before_the_sender_closed_is_still_received(recv_first):
    async with open_local_cluster(5, config=PATIENT) as cluster:
        senders = range(1, 5)
        xs = {src: np.arange(8.0) * src for src in senders}
        pending = {src: cluster[0].recv(src) for src in senders} if recv_first else {}

        async def send_and_close(src):
            await cluster[src].send(xs[src], 0)  # done: x may be modified, and was sent
            await cluster[src].aclose()

        await asyncio.gather(*(send_and_close(src) for src in senders))
        outcomes = await asyncio.gather(
            *(pending.get(src) or cluster[0].recv(src) for src in senders),
            return_exceptions=True,
        )
        for src, outcome in zip(senders, outcomes, strict=True):
            assert isinstance(outcome, np.ndarray), f"from rank {src}: {outcome!r}"
            assert_same_array(outcome, xs[src])


async def test_a_posted_recv_gets_the_message_when_the_registry_reports_the_leave_first():
    # The sender's message and goodbye travel on its link, its leave through the registry:
    # under load the registry's word came first and failed the posted recv. Held here
    # until the registry's word is in, then delivered in the order they came.
    async with open_local_cluster(2, config=PATIENT) as cluster:
        table = cluster[0]._session.table
        kinds = (Kind.PEER_MESSAGE, Kind.GOODBYE)
        originals = {kind: table.inbound[kind] for kind in kinds}
        held: list[tuple[Kind, int, Envelope, list[bytes]]] = []
        for kind in kinds:
            table.inbound[kind] = lambda rank, env, payload, kind=kind: held.append(
                (kind, rank, env, [bytes(p) for p in payload])
            )
        pending = cluster[0].recv(1)
        x = np.arange(8.0)
        await cluster[1].send(x, 0)
        await cluster[1].aclose()
        await eventually(lambda: 1 in table.closed_after, "the registry said rank 1 left", 10)
        table.inbound.update(originals)
        assert [kind for kind, *_ in held] == [Kind.PEER_MESSAGE, Kind.GOODBYE]
        for kind, rank, env, payload in held:
            originals[kind](rank, env, [memoryview(p) for p in payload])
        assert_same_array(await pending, x)


@pytest.mark.parametrize("count", [3 << 18, (3 << 18) + 5], ids=["whole frames", "short tail"])
async def test_after_a_send_completes_the_input_can_be_modified_without_changing_what_arrives(
    count,
):
    async with open_local_cluster(2, config=SMALL_FRAMES) as cluster:
        for attempt in range(4):
            x = np.full(count, attempt, dtype=np.float32)  # over 3 MiB: sent without copying
            await cluster[0].send(x, 1)
            x[:] = -1
            received = await cluster[1].recv(0)
            assert (received == attempt).all(), f"attempt {attempt}: the peer saw the change"


@pytest.mark.parametrize(
    ("call", "message", "refused"),
    [
        (lambda c: c.send(np.ones(2), 1, tag=-1), "tag=-1", False),
        (lambda c: c.send(np.ones(2), 1, tag=1 << 31), "tag=", False),
        (lambda c: c.send(np.ones(2), 2), "dst=2", False),
        (lambda c: c.send(np.ones(2), True), "dst=True", False),
        (lambda c: c.recv(0), "src=0", False),
        (lambda c: c.recv(1, tag="a"), "tag='a'", False),
        (lambda c: c.send([1, 2], 1), "numpy array", True),
        (lambda c: c.send(np.array(["a"]), 1), "not supported", True),
        (lambda c: c.recv(1, timeout=0), "timeout", False),
    ],
)
async def test_bad_arguments_raise_config_error_at_the_call(call, message, refused):
    """A send to a valid peer that is refused here is refused there too (its recv fails);
    with no valid peer, or for a recv, nothing is sent and the stream is untouched."""
    async with open_local_cluster(2, config=PATIENT) as cluster:
        with pytest.raises(ConfigError, match=message):
            call(cluster[0])
        if refused:
            with pytest.raises(CollectiveAbortedError, match=message):
                await cluster[1].recv(0)
        x = np.arange(3)
        received, _ = await asyncio.gather(cluster[1].recv(0), cluster[0].send(x, 1))
        assert_same_array(received, x)


async def test_sends_keep_their_order_when_the_peer_queue_is_full(monkeypatch):
    """A send that must wait for room is not overtaken by later ones (tiny queues here)."""
    import dsml.transport.sockets as sockets

    monkeypatch.setattr(sockets, "_HWM", 4)
    async with open_local_cluster(2, config=PATIENT) as cluster:
        n = 400
        sends = [cluster[0].send(np.array([i]), 1) for i in range(n)]
        received = [int((await cluster[1].recv(0))[0]) for _ in range(n)]
        await asyncio.gather(*sends)
        assert received == list(range(n))


async def test_a_send_this_rank_refuses_fails_the_matching_recv_at_once_and_the_stream_goes_on():
    """Before, the receiver waited for its timeout (or took the next message in its
    place): a send refused on its own rank never reached the peer."""
    async with open_local_cluster(2, config=PATIENT) as cluster:
        waiting = cluster[1].recv(0, tag=5)
        with pytest.raises(ConfigError, match="dtype object"):
            cluster[0].send(np.array([1.0, 2.0], dtype=object), 1, tag=5)
        started = asyncio.get_running_loop().time()
        with pytest.raises(CollectiveAbortedError, match="rank 0 refused the matching send"):
            await waiting
        assert asyncio.get_running_loop().time() - started < 5
        # The refusal took the send's place: the next message is the next recv's.
        await cluster[0].send(np.arange(3.0), 1, tag=5)
        assert_same_array(await cluster[1].recv(0, tag=5), np.arange(3.0))


async def test_a_refused_send_keeps_its_place_between_the_sends_around_it():
    async with open_local_cluster(2, config=PATIENT) as cluster:
        before = cluster[0].send(np.arange(2.0), 1)  # started, not yet run
        with pytest.raises(ConfigError):
            cluster[0].send(np.array([None]), 1)
        after = cluster[0].send(np.arange(4.0), 1)
        assert_same_array(await cluster[1].recv(0), np.arange(2.0))
        with pytest.raises(CollectiveAbortedError, match="refused the matching send"):
            await cluster[1].recv(0)
        assert_same_array(await cluster[1].recv(0), np.arange(4.0))
        await asyncio.gather(before, after)


async def test_a_rank_closing_right_after_a_refused_send_still_tells_the_receiver_why():
    """The refusal goes out from a task; the sender's goodbye went out before it ran, and
    the receiver failed as if the sender had just left (new-user probe)."""
    async with open_local_cluster(2, config=PATIENT) as cluster:
        waiting = cluster[1].recv(0)
        with pytest.raises(ConfigError, match="dtype object"):
            cluster[0].send(np.array([object()]), 1)
        await cluster[0].aclose()  # at once: no other await in between
        with pytest.raises(CollectiveAbortedError, match="rank 0 refused the matching send"):
            await waiting


async def test_a_send_refused_for_its_timeout_is_refused_to_the_receiver_too():
    async with open_local_cluster(2, config=PATIENT) as cluster:
        with pytest.raises(ConfigError, match="timeout"):
            cluster[0].send(np.arange(2.0), 1, timeout=-1)
        with pytest.raises(CollectiveAbortedError, match="refused the matching send: timeout"):
            await cluster[1].recv(0)


async def test_a_masked_array_is_sent_as_its_data_as_collectives_take_it():
    async with open_local_cluster(2, config=PATIENT) as cluster:
        x = np.ma.array(np.arange(6.0), mask=[True, False] * 3)
        sent = cluster[0].send(x, 1)
        got = await cluster[1].recv(0)
        await sent
        assert_same_array(got, np.arange(6.0))


async def test_sends_keep_their_frames_within_what_the_peer_accepts():
    """The sender's own max_frame_bytes and chunk_bytes no longer size its frames alone:
    the receiver's limit (in its view record) may be lower, and ZeroMQ drops the
    connection of a peer that sends more (before: the message lost, the receiver later
    evicted)."""
    small = CommConfig(timeout=30, chunk_bytes=1 << 20, max_frame_bytes=1 << 20)
    large = CommConfig(timeout=30, chunk_bytes=4 << 20, max_frame_bytes=64 << 20)
    async with dsml.open_registry() as registry:
        joins = [
            dsml.init(registry.address, world_size=2, rank=r, config=c)
            for r, c in enumerate([large, small])
        ]
        comms = await asyncio.gather(*joins)
        try:
            assert [m.max_frame for m in comms[0].view.members] == [64 << 20, 1 << 20]
            x = np.arange(3 << 20, dtype=np.float32)  # 12 MiB
            sent = comms[0].send(x, 1)
            assert_same_array(await comms[1].recv(0), x)
            await sent
        finally:
            await asyncio.gather(*(c.aclose() for c in comms))


async def test_a_recv_cancelled_before_it_starts_leaves_no_unawaited_coroutine():
    """Cancelled in the same step it was made (a Ctrl-C as the call starts): no
    "coroutine ... was never awaited" warning when it is collected."""
    import gc
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with open_local_cluster(2, config=PATIENT) as cluster:
            handle = cluster[0].recv(1)
            handle.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await handle
            del handle
        gc.collect()
    unawaited = [w for w in caught if "never awaited" in str(w.message)]
    assert not unawaited, [str(w.message) for w in unawaited]


async def test_a_recv_whose_await_is_cancelled_as_it_ends_gives_its_message_back():
    """The await is cancelled in the turn the receive took its message (a wait_for's
    timeout then): the message goes back to the head of its stream, for the next recv,
    and the given-up handle does not hand it out too."""
    async with open_local_cluster(2, config=PATIENT) as cluster:
        handle = cluster[1].recv(0)
        waiter: asyncio.Future[np.ndarray] | None = None
        # Runs before the waiter's own wake-up: it is cancelled with the result ready.
        handle.add_done_callback(lambda _h: waiter is not None and waiter.cancel())

        async def take() -> np.ndarray:
            return await handle

        waiter = asyncio.ensure_future(take())
        await asyncio.sleep(0)
        await cluster[0].send(np.arange(3.0), 1)
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert handle.done()
        assert not handle.cancelled()
        with pytest.raises(asyncio.CancelledError):
            handle.result()
        await cluster[0].send(np.arange(4.0), 1)
        assert_same_array(await cluster[1].recv(0), np.arange(3.0))
        assert_same_array(await cluster[1].recv(0), np.arange(4.0))


async def test_a_recv_handle_cancelled_once_it_ended_keeps_its_message():
    """Cancelling a receive that has ended changes nothing: its handle still gives the
    message, and nothing goes back to the stream (it would come twice)."""
    async with open_local_cluster(2, config=PATIENT) as cluster:
        first, second = cluster[1].recv(0), cluster[1].recv(0)
        await cluster[0].send(np.arange(1.0), 1)
        await cluster[0].send(np.arange(2.0), 1)
        assert_same_array(await second, np.arange(2.0))
        assert first.done()
        first.cancel()  # too late: it has its message
        assert_same_array(await first, np.arange(1.0))
        await cluster[0].send(np.arange(5.0), 1)
        assert_same_array(await cluster[1].recv(0), np.arange(5.0))
