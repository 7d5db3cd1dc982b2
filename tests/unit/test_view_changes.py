"""The view state machine, one transition at a time, without sockets (see TRANSITIONS)."""

from __future__ import annotations

import asyncio

import pytest

from dsml.communicator.call import Call
from dsml.communicator.call_table import CallTable
from dsml.communicator.view_changes import ViewChanges
from dsml.communicator.view_states import TRANSITIONS, ViewState
from dsml.errors import EvictedError, PeerLostError
from dsml.membership import Change
from dsml.wire import Fingerprint

from .fakes import FakeLinks, FakeRegistry, member, view

S = ViewState
FP = Fingerprint("barrier")


def machine(*ids: int) -> tuple[ViewChanges, CallTable, FakeLinks, FakeRegistry]:
    links, registry = FakeLinks(), FakeRegistry()
    table = CallTable(links, links.config)  # type: ignore[arg-type]
    views = ViewChanges(table, links, registry, view_timeout=1.0)  # type: ignore[arg-type]
    views.install_first(view(1, *(ids or (0, 1, 2))))
    return views, table, links, registry


def last(views: ViewChanges) -> tuple[str, ViewState, ViewState]:
    event, before, after = views.history[-1]
    assert after in TRANSITIONS[event][before], "a transition the table does not list"
    return event, before, after


def in_flight(table: CallTable) -> Call:
    call = Call(table, table.take_cid(), FP, 10.0)
    table.register(call)
    return call


async def test_formed_installs_the_first_view_and_runs_calls_at_once():
    views, table, links, _ = machine()
    assert last(views) == ("formed", S.JOINING, S.STEADY)
    assert links.epoch == 1
    assert table.next_cid == 1
    assert views.immediate()


async def test_formed_with_a_goodbye_held_for_it_leaves_the_member_left_at_once():
    """A peer that closed before this rank had its first view: its goodbye, held for
    that view, is delivered as the view is entered (a probe saw the transition logged
    as a bug)."""
    links, registry = FakeLinks(), FakeRegistry()
    table = CallTable(links, links.config)  # type: ignore[arg-type]
    views = ViewChanges(table, links, registry, view_timeout=1.0)  # type: ignore[arg-type]
    enter = links.enter

    def enter_and_deliver(first):  # what the real links do with messages held for it
        enter(first)
        views.peer_left(2, 0, table.peer_closed(2, 0, None))  # as handle_goodbye does

    links.enter = enter_and_deliver  # type: ignore[method-assign]
    views.install_first(view(1, 0, 1, 2))
    assert views.history[0] == ("peer left", S.STEADY, S.MEMBER_LEFT)
    assert last(views) == ("formed", S.JOINING, S.MEMBER_LEFT)
    await views.admit()  # call #1: it fails at its start (the member made no call)
    doomed = in_flight(table)
    assert table.check_start(doomed) is not None
    table.finish(doomed)


async def test_member_lost_fails_calls_in_flight_then_installs_the_survivors_view():
    views, table, links, _ = machine()
    call = in_flight(table)
    views.on_view(view(2, 0, 2), Change(previous=1, lost=("m1",)))
    assert last(views) == ("view", S.STEADY, S.MEMBER_LOST)
    assert isinstance(call.failure, PeerLostError)  # delivered as a value
    assert list(call.failure.lost) == [1]
    assert not views.immediate()
    table.finish(call)
    await views.admit()  # the loss was seen by a call already: the next one runs
    assert last(views) == ("installed", S.MEMBER_LOST, S.STEADY)
    assert links.epoch == 2
    assert links.rank == 0
    assert table.next_cid == 1


async def test_member_lost_with_no_call_in_flight_fails_the_next_call_once():
    views, _table, links, _ = machine()
    views.on_view(view(2, 0, 1), Change(previous=1, lost=("m2",)))
    with pytest.raises(PeerLostError):
        await views.admit()
    await views.admit()
    assert links.epoch == 2
    assert views.state is S.STEADY


async def test_member_left_lets_its_last_calls_run_then_moves_on():
    views, table, links, _ = machine()
    views.on_view(view(2, 0, 1), Change(previous=1, left=(("m2", 2),)))
    assert last(views) == ("view", S.STEADY, S.MEMBER_LEFT)
    for _ in range(2):  # calls #1 and #2 still run in epoch 1 (the leaver made them)
        await views.admit()
        table.finish(in_flight(table))
    assert links.epoch == 1
    await views.admit()  # #3: fails at its start (the member closed); not here
    doomed = in_flight(table)
    assert table.check_start(doomed) is not None
    table.finish(doomed)
    await views.admit()
    assert last(views) == ("installed", S.MEMBER_LEFT, S.STEADY)
    assert links.epoch == 2


async def test_joiner_admitted_at_the_agreed_boundary():
    views, _table, links, registry = machine(0, 1)
    views.on_propose(2)
    assert last(views) == ("proposal", S.STEADY, S.JOIN_PROPOSED)
    assert registry.ready_calls == [(2, 1)]  # (the proposal, our next collective id)
    assert not views.immediate()  # call #1 waits for the registry's answer
    views.on_view(view(2, 0, 1, 3), Change(previous=1, boundary=1, joined=("m3",)))
    assert last(views) == ("view", S.JOIN_PROPOSED, S.JOIN_AGREED)
    await views.admit()
    assert last(views) == ("installed", S.JOIN_AGREED, S.STEADY)
    assert links.view is not None
    assert links.view.members[2] == member(3)
    assert views.immediate()


async def test_registry_lost_and_back_drops_its_proposal():
    views, _table, _links, _ = machine()
    views.on_propose(2)
    assert not views.immediate()
    views.on_reregister()
    assert last(views) == ("registry back", S.JOIN_PROPOSED, S.STEADY)
    assert views.immediate()


async def test_a_stale_view_or_eviction_changes_nothing():
    views, _table, links, _ = machine()
    views.on_view(view(1, 0, 1), Change(previous=0, lost=("m2",)))
    assert last(views) == ("view", S.STEADY, S.STEADY)
    views.on_evicted(1, "old news")
    assert last(views) == ("evicted", S.STEADY, S.STEADY)
    assert links.epoch == 1
    assert views.immediate()


async def test_a_future_view_skipping_epochs_is_installed_at_the_next_call():
    views, table, links, _ = machine()
    views.on_view(view(5, 0, 1), Change(previous=3, lost=("m2",)))  # epochs 2-4 missed
    assert views.state is S.MEMBER_LOST
    with pytest.raises(PeerLostError):
        await views.admit()
    await views.admit()
    assert links.epoch == 5
    assert table.next_cid == 1


async def test_evicted_fails_every_call_now_and_later():
    views, table, _links, registry = machine()
    call = in_flight(table)
    views.on_evicted(2, "silent for too long")
    assert last(views) == ("evicted", S.STEADY, S.EVICTED)
    assert isinstance(call.failure, EvictedError)
    assert registry.heartbeats is False
    with pytest.raises(EvictedError):
        await views.admit()


async def test_a_dropped_peer_without_word_from_the_registry_counts_as_lost():
    views, table, _links, _registry = machine()
    call = in_flight(table)
    views._lost_locally("m1", 1)  # what peer_disconnected schedules after a second
    assert last(views) == ("peer dropped", S.STEADY, S.MEMBER_LOST)
    assert isinstance(call.failure, PeerLostError)


async def test_waiting_for_a_view_change_returns_the_announced_view():
    views, _table, _links, _ = machine()
    waiter = asyncio.ensure_future(views.wait_known(1.0))
    await asyncio.sleep(0)
    views.on_view(view(2, 0, 1), Change(previous=1, lost=("m2",)))
    assert (await waiter).epoch == 2
