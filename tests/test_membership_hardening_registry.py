"""The registry adopting views the survivors agreed on while it was away (in-process).

Members here are bare `RegistryClient`s (no data plane), so each message of the
membership protocol is driven by the test: real sockets on loopback, a real registry.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import pytest

from dsml.config import CommConfig, RegistryConfig
from dsml.membership import Change, Member, RegistryClient, View, open_registry
from dsml.membership.agreement import successor
from tests.waiting import eventually

WORLD = 4
CONFIG = CommConfig(registry_timeout=5, join_timeout=10)


class Recorder:
    """A Listener that keeps what the registry said."""

    def __init__(self) -> None:
        self.views: list[tuple[View, Change]] = []
        self.evicted: list[tuple[int, str]] = []
        self.reregistered = 0

    def on_view(self, view: View, change: Change) -> None:
        self.views.append((view, change))

    def on_propose(self, epoch: int) -> None:
        pass

    def on_evicted(self, epoch: int, reason: str) -> None:
        self.evicted.append((epoch, reason))

    def on_reregister(self) -> None:
        self.reregistered += 1


async def join_group(address: str, n: int = WORLD) -> tuple[list[RegistryClient], list[Recorder]]:
    clients = []
    for i in range(n):
        member = Member(id=secrets.token_hex(8), address=f"tcp://127.0.0.1:{40000 + i}")
        client = RegistryClient(address, member, CONFIG)
        client.open()
        clients.append(client)
    await asyncio.gather(*(c.join(n, rank=r) for r, c in enumerate(clients)))
    recorders = [Recorder() for _ in clients]
    for client, recorder in zip(clients, recorders, strict=True):
        client.attach(recorder)
    return clients, recorders


async def close_all(clients: list[RegistryClient]) -> None:
    await asyncio.gather(*(c.aclose(linger_s=0) for c in clients))


def beat(epoch: int) -> Any:
    return lambda: {"epoch": epoch, "started": None, "finished": None, "counters": {"held": 0}}


async def test_the_registry_adopts_the_view_the_survivors_agreed_on_and_evicts_the_lost():
    config = RegistryConfig(heartbeat_interval=0.05, heartbeat_timeout=5)
    async with open_registry(config=config) as registry:
        clients, recorders = await join_group(registry.address)
        try:
            view = clients[0].view
            assert view is not None
            lost = view.members[3].id
            agreed = successor(view, [lost])
            for client in clients[:3]:
                client.agreed(agreed, view.epoch, [lost])
            await eventually(lambda: registry.epoch == agreed.epoch, "the view adopted")
            assert registry.view == agreed
            assert registry.status()["views_adopted"] == 1
            await eventually(lambda: recorders[3].evicted, "the lost member told")
            assert recorders[3].evicted[0][0] == agreed.epoch
            assert "went on without it" in recorders[3].evicted[0][1]
            assert lost in registry.status()["evicted"]
            assert all(not r.evicted for r in recorders[:3])
        finally:
            await close_all(clients)


async def test_a_heartbeat_from_a_newer_epoch_makes_the_registry_ask_for_that_view():
    """The VIEW_AGREED message was lost (say, the registry restarted): the heartbeats carry
    the newer epoch, the registry asks (REREGISTER), the member answers (REJOIN)."""
    config = RegistryConfig(heartbeat_interval=0.05, heartbeat_timeout=5)
    async with open_registry(config=config) as registry:
        clients, recorders = await join_group(registry.address)
        try:
            view = clients[0].view
            assert view is not None
            agreed = successor(view, [view.members[0].id])
            for client in clients[1:]:
                client.view = agreed  # installed without telling the registry
                client.start_heartbeats(beat(agreed.epoch))
            await eventually(lambda: registry.view == agreed, "the view adopted")
            # The first REJOIN is adopted, so the members whose next heartbeat came after it
            # (any of them, on a loaded machine) were never asked: one was, at least.
            assert any(r.reregistered >= 1 for r in recorders[1:])
            status = registry.status()
            assert [m["id"] for m in status["members"]] == [m.id for m in agreed.members]
            await eventually(
                lambda: all(m["counters"] == {"held": 0} for m in registry.status()["members"]),
                "the heartbeats' counters shown",
            )
        finally:
            await close_all(clients)


async def test_a_view_that_does_not_descend_from_the_registrys_is_refused():
    async with open_registry() as registry:
        clients, recorders = await join_group(registry.address, 3)
        try:
            view = clients[0].view
            assert view is not None
            reordered = View(view.epoch + 1, (view.members[1], view.members[0]))
            clients[0].agreed(reordered, view.epoch, [view.members[2].id])
            await eventually(lambda: recorders[0].evicted, "the refusal")
            assert "not one of this group's" in recorders[0].evicted[0][1]
            assert registry.view == view
        finally:
            await close_all(clients)


@pytest.mark.parametrize("silent", [1, 2, 3])
async def test_silent_members_are_evicted_only_when_they_cannot_run_on_alone(silent):
    """Of four members, `silent` stop beating but stay connected: one or two are evicted
    after the timeout; three (a majority, which may run on without the registry) are not."""
    config = RegistryConfig(heartbeat_interval=0.05, heartbeat_timeout=0.4)
    async with open_registry(config=config) as registry:
        clients, _recorders = await join_group(registry.address)
        try:
            view = clients[0].view
            assert view is not None
            for client in clients[silent:]:
                client.start_heartbeats(beat(view.epoch))
            await asyncio.sleep(1.2)  # three timeouts
            if 2 * silent > WORLD:
                assert registry.epoch == view.epoch
                assert registry.status()["evicted"] == []
            else:
                await eventually(lambda: registry.epoch > view.epoch, "the eviction")
                assert registry.view is not None
                assert registry.view.size == WORLD - silent
        finally:
            await close_all(clients)


async def test_a_member_most_others_lost_their_links_to_is_cut_off_though_it_reaches_the_registry():
    async with open_registry() as registry:
        clients, recorders = await join_group(registry.address)
        try:
            view = clients[0].view
            assert view is not None
            cut = view.members[3].id
            clients[0].suspect(cut, view.epoch)  # one report: checked, still connected
            await eventually(lambda: registry.epoch == view.epoch + 1, "the epoch renewed")
            assert registry.view is not None
            assert registry.view.size == WORLD
            for client in clients[:3]:
                client.suspect(cut, registry.epoch)
            await eventually(lambda: recorders[3].evicted, "the cut-off member told")
            assert registry.view.size == WORLD - 1
            assert registry.view.rank_of(cut) is None
            reason = recorders[3].evicted[0][1]
            assert "cut off from the group" in reason
            assert f"the address it gave them, {view.members[3].address}" in reason
        finally:
            await close_all(clients)
