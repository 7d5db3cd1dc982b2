"""Hostile input at the registry and at workers: dropped and counted while the system works.

Attackers are raw ZeroMQ DEALER sockets of a context of their own (and one raw TCP
connection); the system under attack is real: a registry, `dsml.init` and an in-process
cluster running all_reduce.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

import dsml
from dsml import CommConfig, RegistryConfig
from dsml.membership import query_status
from dsml.testing import open_local_cluster
from dsml.transport import prove_secret
from dsml.wire import Envelope, Fingerprint, Kind, decode, encode
from tests.waiting import eventually

PATIENT = CommConfig(timeout=30, join_timeout=10, registry_timeout=5)
Frames = list[bytes]


class Attacker:
    """Raw DEALER sockets of a private context; every one is closed with linger 0.

    They prove the job secret (a buggy member, not an outsider: tests/test_security.py
    has those), so what they send is read and must be judged on its bytes alone."""

    def __init__(self) -> None:
        self.context = zmq.asyncio.Context()
        self.sockets: list[zmq.asyncio.Socket] = []

    def dealer(self, address: str, identity: bytes | None = None) -> zmq.asyncio.Socket:
        sock = self.context.socket(zmq.DEALER)
        sock.linger = 0
        prove_secret(sock, identity if identity is not None else os.urandom(8).hex().encode())
        sock.connect(address)
        self.sockets.append(sock)
        return sock

    async def send_all(self, sock: zmq.asyncio.Socket, messages: list[Frames]) -> None:
        for frames in messages:
            await sock.send_multipart(frames)

    async def oversized(self, address: str, nbytes: int) -> None:
        """Send one frame of nbytes and return once the receiver has hung up on us."""
        sock = self.dealer(address)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            await sock.send_multipart([b"\x00" * nbytes])
            async with asyncio.timeout(5):
                event = parse_monitor_message(await monitor.recv_multipart())
            assert event["event"] == zmq.EVENT_DISCONNECTED
        finally:
            sock.disable_monitor()
            monitor.close(0)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(0)
        self.context.term()


@contextlib.asynccontextmanager
async def attacker() -> AsyncIterator[Attacker]:
    attack = Attacker()
    try:
        yield attack
    finally:
        attack.close()


def packed(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def join_request(member_id: str, world_size: Any = 2, epoch: int = 0, **member: Any) -> bytes:
    body = {
        "member": {
            "id": member_id,
            "address": "tcp://127.0.0.1:1",
            "name": "",
            "host": "h",
            "pid": 1,
            **member,
        },
        "world_size": world_size,
        "rank": None,
    }
    return encode(Envelope(Kind.JOIN_REQUEST, epoch, body=body))


# -- at the registry -----------------------------------------------------------------------


def registry_garbage() -> list[Frames]:
    """Messages the registry must drop, each reaching its reader intact."""
    version_2 = packed([2, int(Kind.STATUS_REQUEST), 0, -1, 0, 0, 0, None, None])
    return [
        [b"\xffgarbage\x00\x01"],
        [b""],
        [packed({"kind": 1})],
        [packed([1, 2, 3])],
        [version_2],
        [join_request("alice")],  # the socket's identity is not "alice"
        [join_request("mallory", world_size="two")],
        [join_request("mallory", world_size=0)],
        [join_request("mallory", pid=-5)],
        [join_request("m" * 65)],  # member id too long
        [encode(Envelope(Kind.JOIN_REQUEST, body={"world_size": 2}))],  # no member
        [encode(Envelope(Kind.JOIN_REQUEST, body=None))],
        [encode(Envelope(Kind.CHUNK, 1, 0, 1, fingerprint=Fingerprint("all_reduce")))],
        [encode(Envelope(Kind.JOIN_ACCEPTED, body={"joined": 1}))],  # the registry's own kind
        [encode(Envelope(Kind.VIEW_CHANGED, body={"epoch": 9, "members": []}))],
        [encode(Envelope(Kind.STATUS_REQUEST)), b"unexpected payload"],
        [encode(Envelope(Kind.STATUS_REQUEST)), *[b""] * 4097],  # too many frames
    ]


@contextlib.asynccontextmanager
async def form_group(registry: dsml.Registry) -> AsyncIterator[list[dsml.Communicator]]:
    """Two workers join concurrently; both are closed on the way out."""
    joins = [dsml.init(registry.address, 2, config=PATIENT) for _ in range(2)]
    comms = await asyncio.gather(*joins)
    try:
        assert sorted(c.rank for c in comms) == [0, 1]
        yield comms
    finally:
        await asyncio.gather(*(c.aclose() for c in comms))


async def status_through(sock: zmq.asyncio.Socket) -> dict[str, Any]:
    """Ask the registry for its status on sock: it has read everything sent before."""
    await sock.send_multipart([encode(Envelope(Kind.STATUS_REQUEST))])
    async with asyncio.timeout(5):
        while (reply := decode((await sock.recv_multipart())[0])).kind is not Kind.STATUS_REPLY:
            pass  # a reply to an earlier request (JoinAccepted, JoinRejected)
    assert reply.body is not None
    return reply.body


async def test_the_registry_drops_and_counts_malformed_messages_and_still_forms_a_group():
    config = RegistryConfig(max_message_bytes=4096)
    async with dsml.open_registry(config=config) as registry, attacker() as attack:
        before = registry.dropped_messages
        mallory = attack.dealer(registry.address, identity=b"mallory")
        garbage = registry_garbage()
        await attack.send_all(mallory, garbage)
        await attack.send_all(mallory, [[encode(Envelope(Kind.LEAVE_REQUEST))]])  # ignored
        status = await status_through(mallory)
        assert status["dropped_messages"] >= before + len(garbage)
        assert registry.dropped_messages >= before + len(garbage)
        assert status["joining"] == []  # no malformed join was queued
        assert status["formed"] is False
        await attack.oversized(registry.address, 4097)  # over max_message_bytes
        async with form_group(registry) as (a, b):
            assert registry.view is not None
            assert {m.address for m in registry.view.members} == {a.address, b.address}
            xs = [np.full(4, 1 + c.rank) for c in (a, b)]
            await asyncio.gather(a.all_reduce(xs[a.rank]), b.all_reduce(xs[b.rank]))
            assert all((x == 3).all() for x in xs)
        status = await status_through(mallory)
        assert status["dropped_messages"] >= before + len(garbage)


@pytest.mark.parametrize("address", ["not an address", "tcp://nowhere", ""])
async def test_a_joiner_advertising_an_address_that_is_not_an_address_is_not_admitted(address):
    async with dsml.open_registry() as registry, attacker() as attack:
        evil = attack.dealer(registry.address, identity=b"evil")
        await attack.send_all(evil, [[join_request("evil", address=address)]])
        status = await status_through(evil)
        assert status["joining"] == [], "a member no peer can connect to was queued"
        async with form_group(registry) as comms:  # the group forms without it
            assert all(c.world_size == 2 for c in comms)


async def test_a_joiner_of_a_running_group_with_a_bad_address_is_not_admitted():
    """The address check was skipped for joins into a running group (one review fix)."""
    async with (
        dsml.open_registry() as registry,
        attacker() as attack,
        form_group(registry) as comms,
    ):
        evil = attack.dealer(registry.address, identity=b"evil")
        await attack.send_all(evil, [[join_request("evil", address="tcp://nowhere")]])
        status = await status_through(evil)
        assert any("nowhere" in str(r) for r in status["refused"]), status["refused"]
        xs = [np.ones(2), np.ones(2)]
        await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs, strict=True)))
        assert all(c.world_size == 2 for c in comms)
        assert registry.view is not None
        assert "evil" not in [m.id for m in registry.view.members]


async def test_the_registry_keeps_serving_after_random_bytes_on_a_raw_tcp_connection(seed):
    rng = random.Random(seed)
    async with dsml.open_registry() as registry:
        host, _, port = registry.address.removeprefix("tcp://").rpartition(":")
        writers = []
        try:
            for size in (1, 10, 64, 4096):
                _, writer = await asyncio.open_connection(host, int(port))
                writers.append(writer)
                writer.write(rng.randbytes(size))
                await writer.drain()
            # A ZMTP greeting followed by a frame that claims to be 2**60 bytes long.
            _, writer = await asyncio.open_connection(host, int(port))
            writers.append(writer)
            greeting = b"\xff" + b"\x00" * 8 + b"\x7f\x03\x00NULL" + b"\x00" * 16 + b"\x00" * 32
            writer.write(greeting + b"\x02" + (1 << 60).to_bytes(8, "big"))
            await writer.drain()
            status = await query_status(registry.address)
            assert status["formed"] is False
        finally:
            for writer in writers:
                writer.close()
                with contextlib.suppress(ConnectionError):
                    await writer.wait_closed()
        async with form_group(registry) as comms:
            assert [c.epoch for c in comms] == [1, 1]


# -- at a worker ---------------------------------------------------------------------------


def worker_garbage(epoch: int, cid: int) -> list[Frames]:
    """Messages a worker must drop: malformed, or well-formed but not from a member."""
    fp = Fingerprint("all_reduce", "int64", 16, (16,), "sum", None, "ring")
    abort = {"reason": "failed", "message": "forged", "origin": 1, "ranks": [1]}
    payload = np.full(16, 1000, dtype=np.int64).tobytes()
    return [
        [b"\xffgarbage"],
        [b""],
        [packed({"kind": 20})],
        [packed([1, 20, epoch, 1, cid, 0, 0, None])],  # 8 items
        [encode(Envelope(Kind.CHUNK, epoch, 1, cid, 0, 0, fp)), payload],  # the next call's data
        [encode(Envelope(Kind.CONFIRM, epoch, 1, cid, 0, 0, fp))],
        [encode(Envelope(Kind.ABORT, epoch, 1, cid, fingerprint=fp, body=abort))],
        [encode(Envelope(Kind.PROBE, epoch, 1, cid, fingerprint=fp))],
        [encode(Envelope(Kind.GOODBYE, epoch, 1, body={"last": 0}))],
        [encode(Envelope(Kind.PEER_MESSAGE, epoch, 1, 1, 0, 1, fp)), payload],
        [join_request("intruder", epoch=epoch)],  # not a peer-to-peer kind
    ]


def stale(cid: int) -> Frames:
    fp = Fingerprint("all_reduce", "int64", 16, (16,), "sum")
    return [encode(Envelope(Kind.CHUNK, 0, 1, cid, 0, 0, fp)), b"\x00" * 128]


async def all_reduce_exactly(cluster: Any, round_: int) -> None:
    xs = [np.arange(16, dtype=np.int64) * (c.rank + 1) + round_ for c in cluster]
    expected = sum(xs[r].copy() for r in range(len(cluster)))
    await cluster.run(lambda c: c.all_reduce(xs[c.rank]))
    for x in xs:
        np.testing.assert_array_equal(x, expected)


async def test_workers_drop_hostile_messages_while_all_reduce_stays_exact():
    async with open_local_cluster(3, config=PATIENT) as cluster, attacker() as attack:
        intruders = [attack.dealer(c.address, identity=b"intruder") for c in cluster]
        # Rank 0's own member id: no peer of rank 0 uses it, so its socket gets through.
        me = cluster[0].view.members[0].id.encode()
        impostor = attack.dealer(cluster[0].address, identity=me)
        start = [c.statistics() for c in cluster]
        await all_reduce_exactly(cluster, 0)
        for round_ in range(1, 4):
            epoch, cid = cluster[0].epoch, cluster[0].statistics()["next_cid"]
            garbage = worker_garbage(epoch, cid)
            for sock in intruders:
                await attack.send_all(sock, [*garbage, stale(cid)])
            await attack.send_all(impostor, garbage[4:5])
            for rank, comm in enumerate(cluster):
                expected = start[rank]["dropped"] + round_ * (len(garbage) + (rank == 0))
                await eventually(
                    lambda comm=comm, expected=expected: comm.statistics()["dropped"] >= expected,
                    f"rank {rank} dropped round {round_}'s garbage",
                )
                assert comm.statistics()["stale"] >= start[rank]["stale"] + round_
            await all_reduce_exactly(cluster, round_)
        assert all(c.statistics()["in_flight"] == 0 for c in cluster)


async def test_a_member_claiming_another_ranks_source_is_dropped(caplog):
    async with open_local_cluster(3, config=PATIENT) as cluster:
        target = cluster[0]
        before = target.statistics()["dropped"]
        cid = target.statistics()["next_cid"]
        fp = Fingerprint("all_reduce", "int64", 16, (16,), "sum", None, "ring")
        forged = Envelope(Kind.CHUNK, target.epoch, 1, cid, 0, 0, fp)  # src 1, sent by rank 2
        # Rank 2's real channel to rank 0 (a member gone bad): the transport is unchanged.
        await cluster[2]._session.links.send(0, forged, [np.zeros(16, dtype=np.int64).tobytes()])
        await eventually(
            lambda: target.statistics()["dropped"] >= before + 1, "the forged message dropped"
        )
        assert "rank 2 claims to be rank 1" in caplog.text
        await all_reduce_exactly(cluster, 5)


async def test_an_oversized_frame_to_a_worker_is_refused_and_the_worker_carries_on():
    config = CommConfig(timeout=30, chunk_bytes=1 << 16, max_frame_bytes=1 << 16)
    async with open_local_cluster(2, config=config) as cluster, attacker() as attack:
        await attack.oversized(cluster[1].address, (1 << 16) + 1)
        await all_reduce_exactly(cluster, 1)
        x = np.arange(1 << 15, dtype=np.int64)  # 256 KiB in 64 KiB frames
        received, _ = await asyncio.gather(cluster[1].recv(0), cluster[0].send(x, 1))
        np.testing.assert_array_equal(received, x)
