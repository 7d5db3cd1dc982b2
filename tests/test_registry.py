"""Group formation through the registry: ranks, refusals, new epochs, and clear errors."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

import dsml
from dsml import (
    CommConfig,
    ConfigError,
    JoinTimeoutError,
    MemberLeftError,
    RegistryConfig,
    RegistryUnavailableError,
)
from dsml.membership import query_status
from dsml.testing import crash
from tests.waiting import eventually

FAST = CommConfig(join_timeout=10, registry_timeout=5)


def joining(registry: dsml.Registry) -> int:
    return len(registry.status()["joining"])


@contextlib.asynccontextmanager
async def closing(comms: list[dsml.Communicator]) -> AsyncIterator[list[dsml.Communicator]]:
    try:
        yield comms
    finally:
        await asyncio.gather(*(c.aclose() for c in comms))


async def join_one_by_one(
    registry: dsml.Registry, ranks: list[int | None]
) -> list[dsml.Communicator]:
    """Start one init per entry, each after the registry has queued the previous one."""
    tasks: list[asyncio.Future[dsml.Communicator]] = []
    try:
        for index, rank in enumerate(ranks):
            init = dsml.init(registry.address, len(ranks), rank=rank, config=FAST)
            tasks.append(asyncio.ensure_future(init))
            if index < len(ranks) - 1:
                await eventually(lambda n=index + 1: joining(registry) == n, f"{index + 1} joined")
    finally:
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    comms = [c for c in outcomes if isinstance(c, dsml.Communicator)]
    if len(comms) < len(ranks):
        await asyncio.gather(*(c.aclose() for c in comms))
        raise next(o for o in outcomes if isinstance(o, BaseException))
    return comms


async def test_ranks_are_given_in_join_order():
    async with (
        dsml.open_registry() as registry,
        closing(await join_one_by_one(registry, [None, None, None])) as comms,
    ):
        assert [c.rank for c in comms] == [0, 1, 2]
        assert all(c.world_size == 3 for c in comms)
        assert all(c.epoch == 1 for c in comms)
        assert all(c.view == comms[0].view for c in comms)
        assert [m.address for m in comms[0].view.members] == [c.address for c in comms]
        assert registry.view == comms[0].view


@pytest.mark.parametrize(
    ("asked", "expected"),
    [
        ([2, 0, 1], [2, 0, 1]),
        ([None, 0, None], [1, 0, 2]),
        ([None, None, 0, None], [1, 2, 0, 3]),
        ([3, None, None, 1], [3, 0, 2, 1]),
    ],
)
async def test_requested_ranks_are_honoured_and_the_others_fill_the_gaps_in_join_order(
    asked, expected
):
    async with (
        dsml.open_registry() as registry,
        closing(await join_one_by_one(registry, asked)) as comms,
    ):
        assert [c.rank for c in comms] == expected


async def test_a_joiner_asking_for_a_different_world_size_is_refused_naming_both_sizes():
    async with dsml.open_registry() as registry:
        first = asyncio.ensure_future(dsml.init(registry.address, 2, config=FAST))
        await eventually(lambda: joining(registry) == 1, "the first joiner is queued")
        with pytest.raises(ConfigError, match="refused") as refused:
            await dsml.init(registry.address, 3, config=FAST)
        assert "world_size=2" in str(refused.value)
        assert "world_size=3" in str(refused.value)
        # The refusal did not disturb the group being formed.
        second = await dsml.init(registry.address, 2, config=FAST)
        async with closing([await first, second]) as comms:
            assert sorted(c.rank for c in comms) == [0, 1]


async def test_a_rank_already_asked_for_is_refused():
    async with dsml.open_registry() as registry:
        first = asyncio.ensure_future(dsml.init(registry.address, 2, rank=1, config=FAST))
        await eventually(lambda: joining(registry) == 1, "the first joiner is queued")
        with pytest.raises(ConfigError, match="rank 1 was already taken"):
            await dsml.init(registry.address, 2, rank=1, config=FAST)
        second = await dsml.init(registry.address, 2, config=FAST)
        async with closing([await first, second]) as comms:
            assert [c.rank for c in comms] == [1, 0]


async def test_a_joiner_after_the_group_formed_is_admitted_at_the_next_collective():
    async with dsml.open_registry() as registry, dsml.init(registry.address, 1) as comm:
        assert (comm.rank, comm.world_size, comm.epoch) == (0, 1, 1)
        async with dsml.init(registry.address, config=FAST) as joiner:  # no world_size
            assert (joiner.rank, joiner.world_size, joiner.epoch) == (1, 2, 2)
            assert registry.view is not None
            assert registry.view.size == 2
            # The member switches at the agreed boundary: its next collective.
            assert comm.world_size == 2
            xs = [np.full(3, 1.0), np.full(3, 2.0)]
            await asyncio.gather(comm.all_reduce(xs[0]), joiner.all_reduce(xs[1]))
            assert all((x == 3.0).all() for x in xs)
            assert comm.epoch == 2


async def test_a_second_job_waits_for_the_running_group_and_never_joins_it(
    caplog: pytest.LogCaptureFixture,
):
    """It was admitted into the running group, whatever world_size it asked for: its data
    went into the first job's sums. Now it waits for that group to end (a registry forms
    one group at a time), saying so at once in a warning, and failing at its join timeout
    with a message that says so too. The running ranks are of this very process (a
    notebook re-running its `init` cell without closing): both say to close them first."""
    async with dsml.open_registry() as registry:
        comms = await join_one_by_one(registry, [None, None])
        async with closing(comms):
            quick = CommConfig(join_timeout=1.5, registry_timeout=5)
            for size in (1, 2):
                caplog.clear()
                started = time.time()
                with (
                    caplog.at_level(logging.WARNING, "dsml.membership"),
                    pytest.raises(JoinTimeoutError, match="a group of 2 is running") as late,
                ):
                    await dsml.init(registry.address, size, config=quick)
                assert "forms one group at a time" in str(late.value)
                assert "rank(s) 0, 1 of it run in this very process" in str(late.value)
                warned = [r for r in caplog.records if "waits for it to end" in r.message]
                assert len(warned) == 1, caplog.text
                assert warned[0].created - started < 1.0  # at once, not at the timeout
                assert f"a group of 2 (epoch {comms[0].epoch}) is running" in warned[0].message
                assert "Rank(s) 0, 1 of that group run in this very process" in warned[0].message
            xs = [np.full(3, 1.0), np.full(3, 2.0)]
            await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs, strict=True)))
            assert all((x == 3.0).all() for x in xs)
            assert [c.world_size for c in comms] == [2, 2]
            assert registry.status()["refused"] == []


async def test_a_worker_waiting_for_the_group_to_end_is_not_admitted_as_its_members_close():
    """The members of the running group close one after another (the job ends). Each
    close shrank the group, and a worker waiting with the job's world_size was admitted
    into it as a replacement, then lost its last peers at its first call (a probe, 3/3).
    Closed seats are not free: it waits for the group to end and forms the next one."""
    async with dsml.open_registry() as registry:
        comms = list(
            await asyncio.gather(*(dsml.init(registry.address, 3, config=FAST) for _ in range(3)))
        )
        late = asyncio.ensure_future(dsml.init(registry.address, 3, config=FAST))
        try:
            await eventually(lambda: joining(registry) == 1, "the late worker waits")
            for comm in comms:
                await comm.aclose()
                await asyncio.sleep(0.2)  # one at a time: the group shrinks, epoch by epoch
            assert registry.view is None  # the first group ended without it
            assert not late.done()
            assert joining(registry) == 1
            more = [dsml.init(registry.address, 3, config=FAST) for _ in range(2)]
            group = list(await asyncio.gather(late, *more))
        finally:
            if not late.done():
                late.cancel()
        async with closing(group):
            assert sorted(c.rank for c in group) == [0, 1, 2]
            assert len({c.epoch for c in group}) == 1
            xs = [np.full(2, float(i)) for i in range(3)]
            await asyncio.gather(*(c.all_reduce(x) for c, x in zip(group, xs, strict=True)))
            assert all((x == 3.0).all() for x in xs)


async def test_a_member_closing_before_it_entered_the_new_view_holds_up_no_call_there():
    """C closes; A enters the view without C at its next call and waits there for B; B
    closes without having entered it, its `last` collective counted in the old view's
    numbering. Relayed as it was, A took its own call #1 of the new view for one that B
    had done and waited for B's data until its timeout (a probe saw a worker hang so).
    It now counts as no call there: A's call fails at once, and the next runs alone."""
    async with dsml.open_registry() as registry:
        a, b, c = await asyncio.gather(
            *(dsml.init(registry.address, 3, config=FAST) for _ in range(3))
        )
        xs = [np.ones(2) for _ in range(3)]
        for _ in range(5):  # B's `last` is #5
            await asyncio.gather(*(m.all_reduce(x) for m, x in zip((a, b, c), xs, strict=True)))
        await c.aclose()
        await eventually(lambda: registry.view is not None and registry.view.size == 2, "C left")
        try:
            x = np.full(2, 7.0)
            with pytest.raises(MemberLeftError, match="rank 2 left the group"):
                await a.all_reduce(x, timeout=5)  # the first call after a leave fails
            waiting = asyncio.ensure_future(a.all_reduce(x, timeout=5))
            await asyncio.sleep(0.3)  # A entered the view without C and waits for B
            started = time.monotonic()
            await b.aclose()
            with pytest.raises(MemberLeftError, match="rank 1 left the group"):
                await waiting
            assert time.monotonic() - started < 2.5
            assert (x == 7.0).all()  # intact
            await a.all_reduce(x, timeout=5)
            assert (x == 7.0).all()
            assert a.world_size == 1
        finally:
            await a.aclose()


async def test_a_rerun_after_its_group_died_forms_once_the_registry_drops_the_dead():
    """A re-run of the same size while the dead group was still listed was refused at
    once (by the first form of the rule above); it waits, then forms a new group."""
    config = RegistryConfig(
        address="tcp://127.0.0.1:0", heartbeat_interval=0.2, heartbeat_timeout=1.0
    )
    async with dsml.open_registry(config=config) as registry:
        old = await join_one_by_one(registry, [None, None])
        for comm in old:
            await crash(comm)
        again = await asyncio.gather(
            *(dsml.init(registry.address, 2, config=FAST) for _ in range(2))
        )
        async with closing(list(again)) as comms:
            assert sorted(c.rank for c in comms) == [0, 1]
            assert all(c.epoch > 1 for c in comms)
            xs = [np.full(2, 1.0), np.full(2, 5.0)]
            await asyncio.gather(*(c.all_reduce(x) for c, x in zip(comms, xs, strict=True)))
            assert all((x == 6.0).all() for x in xs)


async def test_a_replacement_started_before_the_loss_is_known_takes_the_lost_ranks_place():
    """Started with the job's own world_size while the dead member was still counted, it
    waits; once the loss is known, the group lacks a member and admits it."""
    config = RegistryConfig(
        address="tcp://127.0.0.1:0", heartbeat_interval=0.2, heartbeat_timeout=1.0
    )
    async with dsml.open_registry(config=config) as registry:
        comms = await join_one_by_one(registry, [None, None, None])
        await crash(comms[2])
        replacement = asyncio.ensure_future(dsml.init(registry.address, 3, config=FAST))
        survivors = comms[:2]
        async with closing(survivors):
            await eventually(
                lambda: (
                    registry.view is not None
                    and registry.view.size == 3
                    and comms[2].member_id not in [m.id for m in registry.view.members]
                ),
                "the replacement admitted",
                within=15,
            )
            joiner = await replacement
            async with closing([joiner]):
                everyone = [*survivors, joiner]
                for c in survivors:  # each survivor sees the loss once
                    with contextlib.suppress(dsml.DsmlError):
                        await asyncio.wait_for(c.barrier(), 10)
                results = await asyncio.gather(*(c.all_reduce(np.ones(2)) for c in everyone))
                assert all((r == 3).all() for r in results)


async def test_after_every_member_left_the_registry_forms_a_new_group_at_a_higher_epoch():
    async with dsml.open_registry() as registry:
        epochs = []
        for _ in range(3):
            async with closing(await join_one_by_one(registry, [None, None])) as comms:
                epochs.append({c.epoch for c in comms})
                assert registry.status()["formed"]
            await eventually(lambda: registry.view is None, "every member left")
            assert not registry.status()["formed"]
        assert [len(e) for e in epochs] == [1, 1, 1]
        firsts = [e.pop() for e in epochs]
        assert firsts[0] == 1
        assert firsts == sorted(set(firsts))


async def test_a_member_that_leaves_makes_a_view_of_the_others_and_the_last_ends_the_group():
    async with (
        dsml.open_registry() as registry,
        closing(await join_one_by_one(registry, [None, None, None])) as comms,
    ):
        leaver = comms[0].member_id
        await comms[0].aclose()
        await eventually(lambda: registry.epoch == 2, "a view without rank 0")
        assert registry.view is not None
        assert [m.id for m in registry.view.members] == [c.member_id for c in comms[1:]]
        # The others' next collective fails (rank 0 closed after none), then they go on.
        for _ in range(2):
            outcomes = await asyncio.gather(
                *(c.all_reduce(np.ones(2)) for c in comms[1:]), return_exceptions=True
            )
        assert [c.world_size for c in comms[1:]] == [2, 2]
        assert all(isinstance(o, np.ndarray) and (o == 2).all() for o in outcomes), outcomes
        assert leaver not in [m["id"] for m in registry.status()["members"]]
        await asyncio.gather(*(c.aclose() for c in comms[1:]))
        await eventually(lambda: registry.view is None, "every member left")


async def test_query_status_and_registry_status_describe_the_members():
    async with dsml.open_registry() as registry:
        empty = await query_status(registry.address)
        assert empty["formed"] is False
        assert empty["members"] == []
        assert empty["world_size"] == 0
        async with closing(await join_one_by_one(registry, [None, None])) as comms:
            for status in (await query_status(registry.address), registry.status()):
                assert status["formed"] is True
                assert status["epoch"] == 1
                assert status["world_size"] == 2
                assert status["joining"] == []
                ids = [m.id for m in comms[0].view.members]
                assert [m["id"] for m in status["members"]] == ids
                assert [m["address"] for m in status["members"]] == [c.address for c in comms]
                assert all(m["pid"] > 0 for m in status["members"])
            assert "epoch=1 size=2" in repr(registry)


async def test_the_status_of_a_forming_group_lists_who_has_joined():
    async with dsml.open_registry() as registry:
        first = asyncio.ensure_future(dsml.init(registry.address, 2, name="first", config=FAST))
        await eventually(lambda: joining(registry) == 1, "the first joiner is queued")
        status = await query_status(registry.address)
        assert status["formed"] is False
        assert status["world_size"] == 2
        assert [m["name"] for m in status["joining"]] == ["first"]
        second = await dsml.init(registry.address, 2, config=FAST)
        async with closing([await first, second]):
            assert registry.status()["joining"] == []


def free_tcp_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


async def test_init_without_a_registry_raises_registry_unavailable_after_the_timeout():
    address = free_tcp_address()
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(RegistryUnavailableError) as unavailable:
        await dsml.init(address, 2, config=CommConfig(registry_timeout=0.5))
    elapsed = loop.time() - started
    assert 0.5 <= elapsed < 3
    assert unavailable.value.address == address
    assert address in str(unavailable.value)
    assert "0.5 s" in str(unavailable.value)
    assert isinstance(unavailable.value, ConnectionError)


async def test_init_against_a_port_that_is_not_a_registry_fails_after_the_timeout():
    """A server that answers with other bytes (a wrong port: HTTP, another service) fails
    the ZeroMQ handshake; init's clean-up then sent its leave into a socket with nowhere to
    queue it and hung forever."""

    async def not_zeromq(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n\r\n" + b"\xff" * 100)
        await writer.drain()
        await reader.read()  # keep it open until the client goes
        writer.close()

    server = await asyncio.start_server(not_zeromq, "127.0.0.1", 0)
    address = f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    loop = asyncio.get_running_loop()
    try:
        started = loop.time()
        with pytest.raises(RegistryUnavailableError):
            await dsml.init(address, 2, config=CommConfig(registry_timeout=0.5))
        assert loop.time() - started < 5
    finally:
        server.close()


async def test_query_status_without_a_registry_raises_registry_unavailable():
    with pytest.raises(RegistryUnavailableError):
        await query_status(free_tcp_address(), registry_timeout=0.3)


@pytest.mark.parametrize("address", ["localhost:5555", "tcp://localhost", "udp://1.2.3.4:5"])
async def test_a_registry_address_that_is_not_an_address_raises_config_error(address):
    with pytest.raises(ConfigError, match="registry address"):
        dsml.init(address, 2)


async def test_bad_join_arguments_raise_config_error_before_anything_is_sent():
    address = free_tcp_address()
    with pytest.raises(ConfigError, match="world_size"):
        dsml.init(address, 0)
    with pytest.raises(ConfigError, match="rank=2 is out of range for world_size=2"):
        dsml.init(address, 2, rank=2)


async def test_a_registry_that_cannot_bind_raises_config_error():
    async with dsml.open_registry() as first:
        with pytest.raises(ConfigError, match="cannot bind"):
            await dsml.open_registry(config=RegistryConfig(address=first.address))


async def test_a_join_timeout_names_the_workers_the_registry_refused_meanwhile():
    """Before, the accepted worker heard only 'start the missing workers': the one refused
    for asking another world size was never mentioned."""
    async with dsml.open_registry() as registry:
        waiting = asyncio.ensure_future(
            dsml.init(registry.address, 3, config=CommConfig(join_timeout=1.5))
        )
        await eventually(lambda: joining(registry) == 1, "the first worker joined")
        with pytest.raises(ConfigError, match="refused to add this worker"):
            await dsml.init(registry.address, 2)
        with pytest.raises(JoinTimeoutError) as timed_out:
            await waiting
        message = str(timed_out.value)
        assert "1 of 3 members joined" in message
        assert "The registry refused 1 worker(s) meanwhile" in message
        assert "forming a group of world_size=3, but this member asked for world_size=2" in message
        assert len(registry.status()["refused"]) == 1


async def test_a_registry_that_dies_while_the_group_forms_fails_the_join_it_accepted():
    """Before, the accepted worker waited out join_timeout (120 s by default) and then
    blamed missing workers."""
    registry = await dsml.open_registry()
    config = CommConfig(join_timeout=60, registry_timeout=1)
    waiting = asyncio.ensure_future(dsml.init(registry.address, 2, config=config))
    await eventually(lambda: joining(registry) == 1, "the worker joined")
    await registry.aclose()
    started = asyncio.get_running_loop().time()
    with pytest.raises(RegistryUnavailableError, match="stopped answering while the group"):
        await waiting
    assert asyncio.get_running_loop().time() - started < 10  # 4 s of silence, and a resend


async def test_a_joiner_whose_own_loop_stalled_does_not_blame_a_registry_that_answers():
    """Silence is counted in join requests left unanswered, not in time since the registry
    was last heard: a 4.5 s stall of this loop (registry_timeout 1 s) sent no request."""
    config = CommConfig(registry_timeout=1, join_timeout=60)
    async with dsml.open_registry() as registry:
        first = asyncio.ensure_future(dsml.init(registry.address, 2, config=config))
        await eventually(lambda: joining(registry) == 1, "the first worker joined")
        time.sleep(4.5)  # noqa: ASYNC251 - the point: this whole loop stalls
        second = dsml.init(registry.address, 2, config=config)
        async with closing(list(await asyncio.gather(first, second))) as comms:
            assert sorted(c.rank for c in comms) == [0, 1]


async def test_the_group_not_forming_in_time_raises_join_timeout_saying_how_many_joined():
    async with dsml.open_registry() as registry:
        config = CommConfig(join_timeout=0.5, registry_timeout=2)
        with pytest.raises(JoinTimeoutError) as timed_out:
            await dsml.init(registry.address, 2, config=config)
        message = str(timed_out.value)
        assert "within 0.5 s" in message
        assert "1 of 2 members joined" in message
        assert registry.address in message
        assert isinstance(timed_out.value, TimeoutError)
        # The worker that gave up left the queue: a new group of 2 can still form.
        await eventually(lambda: joining(registry) == 0, "the worker that gave up left")
        async with closing(await join_one_by_one(registry, [None, None])) as comms:
            assert [c.rank for c in comms] == [0, 1]
