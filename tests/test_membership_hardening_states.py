"""The view state machine's membership-hardening transitions, without sockets.

"peer left" (a goodbye), "agreed" (the survivors' view without the registry) and
"no quorum", each driven alone on the socket-free fakes of tests/unit (see TRANSITIONS).
"""

from __future__ import annotations

import pytest

from dsml.communicator.call import Call
from dsml.communicator.call_table import CallTable
from dsml.communicator.view_changes import ViewChanges
from dsml.communicator.view_states import TRANSITIONS, ViewState
from dsml.errors import MemberLeftError, NoQuorumError, PeerLostError
from dsml.membership import Change
from dsml.wire import Envelope, Fingerprint, Kind
from tests.unit.fakes import FakeLinks, FakeRegistry, view

S = ViewState
FP = Fingerprint("barrier")


def machine() -> tuple[ViewChanges, CallTable, FakeLinks]:
    links, registry = FakeLinks(), FakeRegistry()
    table = CallTable(links, links.config)  # type: ignore[arg-type]
    views = ViewChanges(table, links, registry, view_timeout=1.0)  # type: ignore[arg-type]
    views.install_first(view(1, 0, 1, 2, 3))
    return views, table, links


def last(views: ViewChanges) -> tuple[str, ViewState, ViewState]:
    event, before, after = views.history[-1]
    assert after in TRANSITIONS[event][before], "a transition the table does not list"
    return event, before, after


def in_flight(table: CallTable) -> Call:
    call = Call(table, table.take_cid(), FP, 10.0)
    table.register(call)
    return call


async def test_a_goodbye_fails_the_call_after_the_leavers_last_once_then_waits_for_the_view():
    views, table, links = machine()
    first = in_flight(table)
    second = in_flight(table)
    table.handle_goodbye(3, Envelope(Kind.GOODBYE, 1, 3, body={"last": 1}), [])
    assert last(views) == ("peer left", S.STEADY, S.MEMBER_LEFT)
    assert first.failure is None  # the leaver made call #1: it runs
    assert isinstance(second.failure, MemberLeftError)
    assert list(second.failure.left) == [3]
    table.finish(first)
    table.finish(second)
    assert not views.immediate()
    views.on_view(view(2, 0, 1, 2), Change(previous=1, left=(("m3", 1),)))
    await views.admit()  # the failure was seen already: the next call installs the view
    assert links.epoch == 2
    assert views.state is S.STEADY


@pytest.mark.parametrize(("entered", "runs"), [(1, True), (0, False)])
async def test_a_leave_counts_its_last_call_in_the_epoch_it_entered(entered: int, runs: bool):
    """The registry relays a leaver's last collective with the epoch it counts in. A
    leaver that was in this rank's epoch made call #1, which runs on (a probe saw it fail
    at a job's end, 11/22, when the last collective was taken for 0 because the registry
    had moved on); one that never entered it made none of its calls."""
    views, table, _links = machine()
    first = in_flight(table)
    second = in_flight(table)
    change = Change(previous=1, left=(("m3", 1),), left_epochs=(("m3", entered),))
    views.on_view(view(2, 0, 1, 2), change)
    assert isinstance(second.failure, MemberLeftError)
    if runs:
        assert first.failure is None
    else:
        assert isinstance(first.failure, MemberLeftError)


async def test_the_survivors_agreed_view_is_installed_like_the_registrys():
    views, table, links = machine()
    call = in_flight(table)
    views.on_agreed(view(2, 0, 1, 2), ["m3"])
    assert last(views) == ("agreed", S.STEADY, S.MEMBER_LOST)
    assert isinstance(call.failure, PeerLostError)
    assert views.next_view().epoch == 2
    table.finish(call)
    await views.admit()
    assert links.epoch == 2
    assert links.rank == 0


async def test_no_quorum_fails_calls_in_flight_and_later_until_a_view_comes():
    views, table, links = machine()
    call = in_flight(table)
    error = NoQuorumError("only 1 of the 4 members are reachable")
    views.on_no_quorum(error)
    assert last(views) == ("no quorum", S.STEADY, S.NO_QUORUM)
    assert isinstance(call.failure, NoQuorumError)
    table.finish(call)
    for _ in range(3):  # every call fails at once, none waits
        with pytest.raises(NoQuorumError, match="reachable"):
            await views.admit()
    views.on_view(view(2, 0, 1, 2, 3), Change(previous=1))  # the registry renewed the epoch
    assert views.state is S.MEMBER_LOST
    await views.admit()
    assert links.epoch == 2
    assert views.state is S.STEADY
