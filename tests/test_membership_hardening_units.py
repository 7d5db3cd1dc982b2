"""The pure rules of membership hardening, one by one (no sockets).

- `agreement`: the successor view, quorum, survivors agreeing among themselves.
- `holding`: messages for a future epoch held only from members, within a budget.
- `liveness`: who the registry may evict, and noticing its own stall.
"""

from __future__ import annotations

import itertools
import random

import pytest

from dsml.errors import MembershipChangedError, NoQuorumError
from dsml.membership import Member, View
from dsml.membership.agreement import Agreement, digest, has_quorum, successor
from dsml.membership.holding import FutureHold, HoldBudget
from dsml.membership.liveness import Liveness, StallDetector, evictable
from dsml.membership.peerwatch import PeerWatch


def make_view(n: int, epoch: int = 3) -> View:
    members = tuple(Member(id=f"m{i}", address=f"tcp://127.0.0.1:{5000 + i}") for i in range(n))
    return View(epoch, members)


# -- agreement ----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_the_successor_view_keeps_ring_order_and_bumps_the_epoch(n):
    view = make_view(n)
    for lost in itertools.combinations([m.id for m in view.members], n // 2):
        if len(lost) == n:
            continue
        after = successor(view, lost)
        assert after.epoch == view.epoch + 1
        assert [m.id for m in after.members] == [m.id for m in view.members if m.id not in lost]
        assert after.rank_of(after.members[0].id) == 0


def test_the_successor_of_every_member_lost_is_an_error():
    with pytest.raises(ValueError, match="at least one"):
        successor(make_view(2), ["m0", "m1"])


def test_the_digest_names_a_view_by_its_epoch_and_ordered_members():
    view = make_view(4)
    assert digest(successor(view, ["m1"])) == digest(successor(view, {"m1"}))
    assert digest(successor(view, ["m1"])) != digest(successor(view, ["m2"]))
    assert digest(view) != digest(View(view.epoch + 1, view.members))
    assert digest(view) != digest(View(view.epoch, tuple(reversed(view.members))))


@pytest.mark.parametrize(
    ("n", "alive", "quorate"),
    [(1, 1, True), (2, 1, False), (3, 2, True), (4, 2, False), (4, 3, True), (5, 3, True),
     (7, 3, False), (7, 4, True)],
)  # fmt: skip
def test_only_a_strict_majority_of_the_previous_view_has_quorum(n, alive, quorate):
    view = make_view(n)
    assert has_quorum(view, [m.id for m in view.members[:alive]]) is quorate
    assert has_quorum(view, ["stranger"] * n) is False


def run_agreement(n: int, cut: set[frozenset[str]], seed: int) -> dict[str, Agreement]:
    """Members of a view of n; `cut` lists pairs that cannot talk. Everyone suspects the
    members it cannot reach, then proposals are delivered in a random order (first-in
    first-out on each link) until quiet.
    """
    rng = random.Random(seed)
    view = make_view(n)
    ids = [m.id for m in view.members]
    agreements = {m: Agreement(view, m) for m in ids}
    queue: list[tuple[str, str, frozenset[str]]] = []

    def send(sender: str) -> None:
        proposal = agreements[sender].proposal()
        for peer in ids:
            if peer != sender and frozenset((sender, peer)) not in cut:
                queue.append((sender, peer, proposal))

    for me in ids:
        agreements[me].suspect(p for p in ids if frozenset((me, p)) in cut)
        send(me)
    while queue:  # links in a random order, each link first-in first-out (as TCP)
        pick = queue[rng.randrange(len(queue))]
        first = next(i for i, q in enumerate(queue) if q[:2] == pick[:2])
        sender, peer, proposal = queue.pop(first)
        if agreements[peer].receive(sender, view.epoch, proposal):
            send(peer)
    return agreements


@pytest.mark.parametrize("seed", range(20))
def test_survivors_of_a_3_plus_1_partition_agree_on_one_view_and_the_minority_waits(seed):
    ids = [f"m{i}" for i in range(4)]
    lone = ids[seed % 4]
    cut = {frozenset((lone, other)) for other in ids if other != lone}
    agreements = run_agreement(4, cut, seed)
    decided = {m: a.decided for m, a in agreements.items()}
    survivors = [m for m in ids if m != lone]
    views = {digest(decided[m]) for m in survivors if decided[m] is not None}
    assert len(views) == 1, decided
    view = decided[survivors[0]]
    assert view is not None
    assert [m.id for m in view.members] == survivors
    assert view.epoch == 4
    assert decided[lone] is None
    with pytest.raises(NoQuorumError) as raised:
        agreements[lone].check_quorum()
    assert isinstance(raised.value, MembershipChangedError)
    assert "not a majority" in str(raised.value)


@pytest.mark.parametrize("seed", range(20))
def test_neither_side_of_a_2_plus_2_partition_forms_a_view(seed):
    rng = random.Random(seed)
    ids = [f"m{i}" for i in range(4)]
    rng.shuffle(ids)
    left, right = ids[:2], ids[2:]
    cut = {frozenset((a, b)) for a in left for b in right}
    agreements = run_agreement(4, cut, seed)
    assert all(a.decided is None for a in agreements.values())
    for agreement in agreements.values():
        with pytest.raises(NoQuorumError):
            agreement.check_quorum()


@pytest.mark.parametrize("seed", range(20))
def test_members_that_suspect_each_other_are_both_dropped_and_the_rest_agree(seed):
    """A cut between m1 and m2 only, in a group of 5: the union rule drops both; the
    three others still have quorum and agree; m1 and m2 decide nothing."""
    agreements = run_agreement(5, {frozenset(("m1", "m2"))}, seed)
    decided = {m: a.decided for m, a in agreements.items()}
    for m in ("m0", "m3", "m4"):
        view = decided[m]
        assert view is not None, agreements[m]
        assert [x.id for x in view.members] == ["m0", "m3", "m4"]
    assert decided["m1"] is None or [x.id for x in decided["m1"].members] == ["m0", "m3", "m4"]


@pytest.mark.parametrize("seed", range(30))
def test_random_cuts_never_decide_two_different_views(seed):
    rng = random.Random(seed)
    n = rng.choice([3, 4, 5, 7])
    ids = [f"m{i}" for i in range(n)]
    pairs = [frozenset(p) for p in itertools.combinations(ids, 2)]
    cut = set(rng.sample(pairs, rng.randrange(len(pairs) // 2 + 1)))
    agreements = run_agreement(n, cut, seed)
    decided = [a.decided for a in agreements.values() if a.decided is not None]
    print(f"seed {seed}: n={n}, cut={sorted(tuple(sorted(c)) for c in cut)}")
    assert len({digest(v) for v in decided}) <= 1
    for view in decided:
        assert has_quorum(make_view(n), [m.id for m in view.members])
        for a in itertools.combinations([m.id for m in view.members], 2):
            assert frozenset(a) not in cut  # every pair of the agreed group can talk


def test_a_proposal_from_a_lost_member_or_another_epoch_is_ignored():
    view = make_view(4)
    agreement = Agreement(view, "m0")
    agreement.suspect(["m3"])
    assert not agreement.receive("m3", view.epoch, ["m1"])  # m3 is lost to us
    assert not agreement.receive("m1", view.epoch + 1, ["m2"])  # another epoch
    assert not agreement.receive("stranger", view.epoch, ["m1"])
    assert agreement.lost == {"m3"}


def test_nothing_is_decided_before_this_member_proposed_the_current_set():
    view = make_view(3)
    agreement = Agreement(view, "m0")
    agreement.suspect(["m2"])
    assert agreement.receive("m1", view.epoch, ["m2"]) is False
    assert agreement.decided is None  # m0 has not proposed yet
    agreement.proposal()
    assert agreement.decided is not None
    assert agreement.waiting_for() == []


# -- holding future-epoch messages ------------------------------------------------------


def test_future_messages_are_held_only_from_allowed_senders():
    hold: FutureHold[int] = FutureHold()
    hold.allow(["m1"])
    assert hold.hold("m1", 10, 1) == "held"
    assert hold.hold("stranger", 10, 2) == "foreign"
    assert hold.counters["dropped_foreign"] == 1
    assert hold.release() == [1]
    assert len(hold) == 0
    assert hold.nbytes == 0


def test_the_hold_budget_caps_frames_and_bytes_per_sender_and_in_total():
    budget = HoldBudget(
        max_frames=5, max_bytes=900, max_frames_per_sender=3, max_bytes_per_sender=500
    )
    hold: FutureHold[str] = FutureHold(budget)
    hold.allow(["a", "b", "c"])
    assert [hold.hold("a", 10, f"a{i}") for i in range(4)] == ["held"] * 3 + ["over_budget"]
    assert hold.hold("b", 600, "big") == "over_budget"  # per-sender bytes
    assert hold.hold("b", 450, "b0") == "held"
    assert hold.hold("c", 500, "c0") == "over_budget"  # total bytes: 480 + 500 > 900
    assert hold.hold("c", 100, "c1") == "held"
    assert hold.hold("c", 1, "c2") == "over_budget"  # total frames: 5
    assert hold.frames == 5
    assert hold.counters["dropped_over_budget"] == 4
    assert hold.release() == ["a0", "a1", "a2", "b0", "c1"]  # arrival order
    assert hold.hold("c", 1, "again") == "held"  # the budget is free again


def test_dropping_a_senders_held_messages_frees_its_budget():
    hold: FutureHold[str] = FutureHold(HoldBudget(max_frames=2))
    hold.allow(["a", "b"])
    hold.hold("a", 5, "a0")
    hold.hold("b", 5, "b0")
    assert hold.drop_from(["a"]) == 1
    assert hold.frames == 1
    assert hold.nbytes == 5
    assert hold.hold("b", 5, "b1") == "held"
    assert hold.release() == ["b0", "b1"]


def test_a_hold_budget_must_be_non_negative_integers():
    with pytest.raises(ValueError, match="max_bytes"):
        HoldBudget(max_bytes=-1)


# -- liveness ---------------------------------------------------------------------------


def test_silent_members_are_evicted_only_when_they_cannot_be_a_group_of_their_own():
    members = ["a", "b", "c", "d"]
    live = {m: Liveness(last_seen=100.0) for m in members}
    live["d"].last_seen = 80.0
    assert evictable(members, live, 101.0, 10.0, lambda m: True) == (["d"], [])
    live["c"].last_seen = 80.0  # two of four: no majority, they cannot go on alone
    assert evictable(members, live, 101.0, 10.0, lambda m: True) == (["c", "d"], [])
    live["b"].last_seen = 80.0  # three of four silent: they may run on without us
    assert evictable(members, live, 101.0, 10.0, lambda m: True) == ([], ["b", "c", "d"])
    # ... but those whose connection is gone too have died
    assert evictable(members, live, 101.0, 10.0, lambda m: m != "d") == (["b", "c", "d"], [])
    for m in members:  # the registry heard nobody: it is the one cut off
        live[m].last_seen = 80.0
    assert evictable(members, live, 101.0, 10.0, lambda m: True) == ([], members)
    assert evictable(members, live, 101.0, 10.0, lambda m: False) == (members, [])
    assert evictable(members, live, 85.0, 10.0, lambda m: True) == ([], [])
    assert evictable(["a", "b"], live, 101.0, 10.0, lambda m: True) == ([], ["a", "b"])
    live["a"].last_seen = 100.0  # a group of two: the registry and "a" drop "b"
    assert evictable(["a", "b"], live, 101.0, 10.0, lambda m: True) == (["b"], [])


def test_the_stall_detector_reports_how_late_a_tick_came():
    stall = StallDetector(period=0.2, tolerance=0.1)
    assert stall.tick(0.0) == 0.0
    assert stall.tick(0.25) == 0.0
    assert stall.tick(4.45) == pytest.approx(4.0)
    assert stall.stalls == 1


# -- peers watching each other ------------------------------------------------------------


def test_a_peer_silent_past_the_timeout_is_named_and_idle_links_get_beats():
    watch = PeerWatch(interval=1.0, timeout=5.0)
    watch.reset(["a", "b"], now=0.0)
    assert watch.due(0.0) == ["a", "b"]  # nothing sent yet
    watch.sent("a", 0.0)
    watch.sent("b", 0.5)
    assert watch.due(1.2) == ["a"]
    watch.heard("a", 4.0)
    assert watch.silent(5.5) == ["b"]
    watch.credit(3.0)  # this member itself did not run for 3 s
    assert watch.silent(5.5) == []
    assert watch.silent(8.6) == ["b"]
    watch.heard("stranger", 9.0)  # not a peer: ignored
    assert "stranger" not in watch.last_heard
    watch.reset(["b", "c"], now=10.0)
    assert watch.silent(14.0) == []
    assert sorted(watch.last_heard) == ["b", "c"]
