"""Endpoints, channels, receipts and mailboxes over real ZeroMQ sockets on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
from collections.abc import AsyncIterator

import numpy as np
import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from dsml import ConfigError
from dsml.transport import (
    DONE,
    Channel,
    Endpoint,
    Mailbox,
    check_address,
    live_sockets,
    prove_secret,
    wait_sent,
)
from dsml.transport.addresses import advertised
from dsml.wire import Envelope, Fingerprint, Kind, encode
from tests.waiting import eventually

LOOPBACK = "tcp://127.0.0.1:0"
Arrival = tuple[bytes, Envelope, list[bytes]]


class Inbox:
    """A handler that keeps what an endpoint delivers, and waits for it."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Arrival] = asyncio.Queue()
        self.payload_sizes: list[int] = []

    def __call__(self, sender: bytes, env: Envelope, payload: list[memoryview]) -> None:
        self.payload_sizes.extend(frame.nbytes for frame in payload)
        self.queue.put_nowait((sender, env, [bytes(frame) for frame in payload]))

    async def next(self) -> Arrival:
        async with asyncio.timeout(5):
            return await self.queue.get()


@contextlib.asynccontextmanager
async def endpoint(inbox: Inbox, max_frame_bytes: int = 1 << 20) -> AsyncIterator[Endpoint]:
    ep = Endpoint.bind(LOOPBACK, inbox, max_frame_bytes=max_frame_bytes)
    try:
        yield ep
    finally:
        await ep.aclose()


@contextlib.asynccontextmanager
async def channel(address: str, identity: bytes, **options: int) -> AsyncIterator[Channel]:
    ch = Channel.connect(address, identity, **options)
    try:
        yield ch
    finally:
        await ch.aclose()


def chunk(step: int) -> Envelope:
    return Envelope(Kind.CHUNK, 1, 0, 1, step, 0, Fingerprint("all_reduce", "int8"))


async def test_an_endpoint_binds_an_os_chosen_port_and_reports_it():
    async with endpoint(Inbox()) as ep:
        host, _, port = ep.address.removeprefix("tcp://").rpartition(":")
        assert host == "127.0.0.1"
        assert port.isdigit()
        assert int(port) > 0
        assert ep.address in repr(ep)


async def test_an_ipc_path_a_live_endpoint_holds_is_refused_and_a_stale_one_reused(tmp_path):
    address = f"ipc://{tmp_path / 'reg.ipc'}"
    inbox = Inbox()
    first = Endpoint.bind(address, inbox, max_frame_bytes=1 << 20)
    try:  # ZeroMQ alone would take the path over and cut the first endpoint off
        with pytest.raises(ConfigError, match="something is listening there already"):
            Endpoint.bind(address, Inbox(), max_frame_bytes=1 << 20)
        async with channel(address, b"c") as ch:
            ch.send_nowait(chunk(1))
            sender, env, _ = await inbox.next()  # the first one still serves the path
            assert (sender, env.step) == (b"c", 1)
    finally:
        await first.aclose()
    stale = tmp_path / "stale.ipc"
    with socket.socket(socket.AF_UNIX) as left:
        left.bind(str(stale))  # bound, never listening: what a killed process leaves
    again = Endpoint.bind(f"ipc://{stale}", Inbox(), max_frame_bytes=1 << 20)
    await again.aclose()


async def test_messages_arrive_in_order_with_the_sender_identity_and_every_frame():
    inbox = Inbox()
    async with endpoint(inbox) as ep, channel(ep.address, b"worker-a") as ch:
        payloads = [[bytes([i]) * (i + 1) for i in range(n)] for n in range(6)]
        for step, payload in enumerate(payloads):
            await ch.send(chunk(step), payload)
        for step, payload in enumerate(payloads):
            sender, env, frames = await inbox.next()
            assert sender == b"worker-a"
            assert env == chunk(step)
            assert frames == payload
        assert ep.received == len(payloads)
        assert ep.dropped == 0


async def test_two_channels_are_told_apart_by_their_identity():
    inbox = Inbox()
    async with (
        endpoint(inbox) as ep,
        channel(ep.address, b"left") as left,
        channel(ep.address, b"right") as right,
    ):
        for step in range(20):
            await left.send(chunk(step), [b"L"])
            await right.send(chunk(step), [b"R"])
        seen: dict[bytes, list[int]] = {b"left": [], b"right": []}
        for _ in range(40):
            sender, env, frames = await inbox.next()
            assert frames == [sender[:1].upper()]
            seen[sender].append(env.step)
        assert seen == {b"left": list(range(20)), b"right": list(range(20))}


async def test_an_endpoint_replies_to_a_channel_that_has_a_handler():
    inbox, replies = Inbox(), Inbox()
    async with (
        endpoint(inbox) as ep,
        channel(ep.address, b"client", handler=replies) as ch,  # type: ignore[arg-type]
    ):
        await ch.send(Envelope(Kind.STATUS_REQUEST))
        sender, env, _ = await inbox.next()
        assert env.kind is Kind.STATUS_REQUEST
        assert ep.send_nowait(sender, Envelope(Kind.STATUS_REPLY, body={"n": 1}), [b"extra"])
        _, reply, frames = await replies.next()
        assert reply.kind is Kind.STATUS_REPLY
        assert reply.body == {"n": 1}
        assert frames == [b"extra"]
        assert not ep.send_nowait(b"nobody", Envelope(Kind.STATUS_REPLY))


async def test_a_payload_sent_without_copying_arrives_intact_after_its_receipt_is_done():
    inbox = Inbox()
    async with (
        endpoint(inbox, max_frame_bytes=8 << 20) as ep,
        channel(ep.address, b"zc", copy_threshold=1024) as ch,
    ):
        x = np.arange(1 << 20, dtype=np.int32)  # 4 MiB, far above the threshold
        original = x.tobytes()
        receipt = await ch.send(chunk(0), [memoryview(x)])
        assert receipt is not DONE  # a tracked, zero-copy send
        await receipt.wait()
        assert receipt.done()
        x[:] = -1  # allowed now: ZeroMQ no longer reads the buffer
        _, _, frames = await inbox.next()
        assert frames == [original]
        copied = await ch.send(chunk(1), [b"x" * 1023])  # below the threshold: copied
        assert copied is DONE
        await wait_sent([receipt, copied])
        assert (await inbox.next())[2] == [b"x" * 1023]


async def test_a_receipt_covers_every_frame_sent_without_copying_not_only_the_last():
    inbox = Inbox()
    async with (
        endpoint(inbox, max_frame_bytes=8 << 20) as ep,
        channel(ep.address, b"zc", copy_threshold=1024) as ch,
    ):
        for attempt in range(3):
            x = np.full(1 << 20, attempt, dtype=np.int32)  # 4 MiB: sent without copying
            original = x.tobytes()
            receipt = await ch.send(chunk(attempt), [memoryview(x), b"tail"])  # tail: copied
            await receipt.wait()
            x[:] = -1  # the receipt says ZeroMQ is done with every payload buffer
            _, env, frames = await inbox.next()
            assert env.step == attempt
            assert frames[1] == b"tail"
            assert frames[0] == original, "the peer got bytes written after the receipt"


async def test_a_frame_larger_than_the_limit_never_reaches_the_handler():
    inbox = Inbox()
    context = zmq.asyncio.Context()
    async with endpoint(inbox, max_frame_bytes=4096) as ep:
        sender = context.socket(zmq.DEALER)
        sender.linger = 0
        prove_secret(sender, b"big-sender")
        monitor = sender.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            sender.connect(ep.address)
            await sender.send_multipart([encode(chunk(0)), b"x" * 4097])
            async with asyncio.timeout(5):  # the endpoint hangs up on the sender
                event = parse_monitor_message(await monitor.recv_multipart())
            assert event["event"] == zmq.EVENT_DISCONNECTED
        finally:
            sender.disable_monitor()
            monitor.close(0)
            sender.close(0)
            context.term()
        async with channel(ep.address, b"next") as after:
            await after.send(chunk(1), [b"y" * 4096])  # exactly the limit is allowed
            sender_id, env, frames = await inbox.next()
            assert (sender_id, env.step, frames) == (b"next", 1, [b"y" * 4096])
        assert inbox.queue.empty()
        assert inbox.payload_sizes == [4096]
        assert ep.received == 1


async def test_a_malformed_envelope_is_dropped_and_counted_and_the_reader_keeps_going():
    inbox = Inbox()

    def failing(sender: bytes, env: Envelope, payload: list[memoryview]) -> None:
        if env.step == 0:
            raise RuntimeError("a handler bug")
        inbox(sender, env, payload)

    ep = Endpoint.bind(LOOPBACK, failing, max_frame_bytes=1 << 20, max_envelope_bytes=256)
    try:
        async with channel(ep.address, b"peer") as ch:
            await ch.send(chunk(0))  # the handler raises
            await ch.send(Envelope(Kind.CHUNK, body={"pad": "x" * 300}))  # envelope too large
            await ch.send(chunk(1))
            _, env, _ = await inbox.next()
            assert env.step == 1
            assert ep.dropped == 2
            assert ep.received == 3
    finally:
        await ep.aclose()


async def test_closing_gives_back_every_socket():
    before = live_sockets()
    ep = Endpoint.bind(LOOPBACK, Inbox(), max_frame_bytes=4096)
    channels = [Channel.connect(ep.address, b"c%d" % i) for i in range(3)]
    replying = Channel.connect(ep.address, b"r", handler=Inbox())
    assert live_sockets() == before + 5
    for ch in [*channels, replying]:
        await ch.aclose()
        assert ch.closed
    assert live_sockets() == before + 1
    await ep.aclose()
    assert live_sockets() == before
    assert "closed" in repr(ep)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_first_connection_refused_again_and_again_is_reported_once():
    unreachable: list[float] = []
    ch = Channel.connect(
        f"tcp://127.0.0.1:{_free_port()}", b"u", on_unreachable=lambda: unreachable.append(1)
    )
    try:
        await eventually(lambda: bool(unreachable), "on_unreachable", within=3)
        await asyncio.sleep(0.5)  # libzmq goes on retrying; the report came once
        assert unreachable == [1]
    finally:
        await ch.aclose()


async def test_a_lost_connection_is_a_disconnect_not_unreachable():
    lost: list[str] = []
    ep = Endpoint.bind(LOOPBACK, Inbox(), max_frame_bytes=4096)
    ch = Channel.connect(
        ep.address,
        b"d",
        on_disconnect=lambda: lost.append("disconnect"),
        on_unreachable=lambda: lost.append("unreachable"),
    )
    try:
        await ch.send(chunk(0))
        await eventually(lambda: ch._watch is not None and ch._watch.connected, "connected")
        await ep.aclose()  # the peer goes away; reconnecting to its port now fails
        await eventually(lambda: lost == ["disconnect"], "the disconnect")
        await asyncio.sleep(0.5)
        assert lost == ["disconnect"]
    finally:
        await ch.aclose()


@pytest.mark.parametrize(
    "address",
    [
        None,
        5555,
        "",
        "127.0.0.1:5555",
        "http://127.0.0.1:5555",
        "tcp://127.0.0.1",
        "tcp://:5555",
        "tcp://127.0.0.1:port",
        "tcp://127.0.0.1:",
        "tcp://127.0.0.1:99999",  # ZeroMQ would connect to 99999 - 65536 = 34463
    ],
)
def test_check_address_rejects_what_is_not_an_address(address):
    with pytest.raises(ConfigError, match="peer address"):
        check_address(address, "peer address")


@pytest.mark.parametrize(
    "address", ["tcp://127.0.0.1:5555", "tcp://localhost:1", "tcp://*:*", "ipc:///tmp/sock"]
)
def test_check_address_returns_a_good_address_unchanged(address):
    assert check_address(address, "peer address") == address


async def test_binding_and_connecting_bad_addresses_raise_config_error():
    before = live_sockets()
    with pytest.raises(ConfigError, match="bind address"):
        Endpoint.bind("127.0.0.1:0", Inbox(), max_frame_bytes=4096)
    with pytest.raises(ConfigError, match="cannot bind"):
        Endpoint.bind("tcp://256.1.1.1:0", Inbox(), max_frame_bytes=4096)
    with pytest.raises(ConfigError, match="peer address"):
        Channel.connect("nowhere", b"x")
    assert live_sockets() == before


async def test_binding_an_address_already_in_use_raises_config_error():
    async with endpoint(Inbox()) as first:
        before = live_sockets()
        with pytest.raises(ConfigError, match=first.address):
            Endpoint.bind(first.address, Inbox(), max_frame_bytes=4096)
        assert live_sockets() == before  # the failed socket was closed


# -- Mailbox -------------------------------------------------------------------------------


async def test_a_mailbox_item_put_before_get_is_taken_at_once():
    box: Mailbox[str] = Mailbox()
    box.put("g", "k", "a")
    assert len(box) == 1
    assert box.groups() == ["g"]
    assert await box.get("g", "k") == "a"
    assert len(box) == 0
    assert box.groups() == []


async def test_a_mailbox_get_before_put_waits_for_the_item():
    box: Mailbox[str] = Mailbox()
    waiting = asyncio.ensure_future(box.get("g", "k"))
    await asyncio.sleep(0)  # let it register as the waiter
    assert not waiting.done()
    assert "waiters=1" in repr(box)
    box.put("g", "other", "x")
    box.put("other", "k", "y")
    await asyncio.sleep(0)
    assert not waiting.done()
    box.put("g", "k", "a")
    assert await waiting == "a"
    assert box.first_items("g") == [("other", "x")]  # "a" was handed over, not queued
    assert "waiters=0" in repr(box)


async def test_a_mailbox_is_fifo_per_key_and_keys_are_independent():
    box: Mailbox[int] = Mailbox()
    for i in range(5):
        box.put(1, "a", i)
        box.put(1, "b", 10 + i)
        box.put(2, "a", 20 + i)
    assert [await box.get(1, "b") for _ in range(5)] == [10, 11, 12, 13, 14]
    assert [await box.get(2, "a") for _ in range(5)] == [20, 21, 22, 23, 24]
    assert [await box.get(1, "a") for _ in range(5)] == [0, 1, 2, 3, 4]
    assert len(box) == 0


async def test_mailbox_first_items_peek_without_taking_and_discard_drops_a_key_or_a_group():
    box: Mailbox[int] = Mailbox()
    for i in range(3):
        box.put("g", "a", i)
    box.put("g", "b", 9)
    box.put("h", "a", 7)
    assert sorted(box.first_items("g")) == [("a", 0), ("b", 9)]
    assert sorted(box.first_items("g")) == [("a", 0), ("b", 9)]  # nothing was taken
    assert box.first_items("missing") == []
    assert box.discard("g", "a") == 3
    assert box.discard("g", "a") == 0
    assert box.first_items("g") == [("b", 9)]
    assert box.discard("h") == 1  # a whole group
    assert box.groups() == ["g"]
    assert await box.get("g", "b") == 9
    assert len(box) == 0


async def test_a_cancelled_mailbox_get_leaves_the_item_for_the_next_taker():
    box: Mailbox[str] = Mailbox()
    waiting = asyncio.ensure_future(box.get("g", "k"))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    box.put("g", "k", "a")
    assert box.first_items("g") == [("k", "a")]
    assert await box.get("g", "k") == "a"


_EXIT_SCRIPT = """
import atexit, asyncio, socket, sys
import zmq.utils.garbage as zmq_gc
# Registered before dsml is imported, so it runs after dsml's exit handler and just before
# pyzmq's collector thread stops: what libzmq still holds here is what could crash the exit.
atexit.register(lambda: print(f"at exit held={len(zmq_gc.gc.refs)}", flush=True))
import numpy as np
from dsml.transport import Channel
from dsml.wire import Envelope, Fingerprint, Kind

async def main():
    with socket.socket() as s:  # a port nothing listens on: the frame stays queued
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ch = Channel.connect(f"tcp://127.0.0.1:{port}", b"x")
    env = Envelope(Kind.CHUNK, 1, 0, 1, 0, 0, Fingerprint("all_reduce", "float32"))
    await ch.send(env, [np.ones(1 << 18, dtype=np.float32)])
    await ch.aclose(linger_s=0.5)
    print(f"after close held={len(zmq_gc.gc.refs)}", flush=True)

asyncio.run(main())
"""


def test_no_buffer_sent_without_copying_is_still_held_when_pyzmq_stops_at_exit():
    """libzmq aborts the process if it releases such a buffer while pyzmq's collector
    shuts down (a CI run caught it); dsml's exit handler waits for the release first."""
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "after close held=1",  # the closed socket lingers with the frame queued
        "at exit held=0",
    ]


def test_a_wildcard_bind_is_advertised_as_the_interface_toward_the_registry():
    assert advertised("tcp://0.0.0.0:7000", toward="tcp://127.0.0.1:5555") == (
        "tcp://127.0.0.1:7000"
    )
    assert advertised("tcp://*:7000", toward="tcp://localhost:5555") == "tcp://127.0.0.1:7000"
    assert advertised("tcp://10.0.0.5:7000", toward="tcp://127.0.0.1:5555") == (
        "tcp://10.0.0.5:7000"  # a concrete address is kept as it is
    )
    # toward another network (TEST-NET-1): whichever local interface routes there, a
    # concrete IPv4 address in any case (nothing is sent)
    host = advertised("tcp://0.0.0.0:7000", toward="tcp://192.0.2.1:5555")[6:].rsplit(":")[0]
    socket.inet_aton(host)
    assert host != "0.0.0.0"
    # no usable registry address: what the host name resolves to
    assert advertised("tcp://*:7000", toward="ipc:///tmp/r")[6:].endswith(":7000")


async def test_an_endpoints_port_can_be_bound_again_as_soon_as_aclose_returns() -> None:
    # ZeroMQ closes the listening descriptor in its I/O thread after zmq_close: without
    # waiting for that, a third or so of these rebinds failed with EADDRINUSE.
    for _ in range(40):
        ep = Endpoint.bind(LOOPBACK, Inbox(), max_frame_bytes=4096)
        port = int(ep.address.rpartition(":")[2])
        await ep.aclose()
        with socket.socket() as s:
            # SO_REUSEADDR lets the bind through connections in TIME_WAIT, never past a
            # listening socket.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
