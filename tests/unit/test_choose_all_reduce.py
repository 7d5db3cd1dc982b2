"""What an all_reduce runs, decided in one place (plan_reductions.choose_all_reduce),
driven with a fake shared-memory hook and a fake `auto` chooser, without sockets."""

from __future__ import annotations

from typing import Any

import pytest

from dsml.collectives import NUMPY
from dsml.collectives.select import choose_all_reduce as by_size
from dsml.communicator.plan_reductions import all_reduce_choice, choose_all_reduce
from dsml.communicator.plan_state import PlanState

NBYTES = 4096


class FakeShm:
    """The answers of a `ShmHook`: whether the call runs in shared memory or may run
    hierarchical; records the turns taken."""

    def __init__(self, local: bool = False, hierarchical: bool = False) -> None:
        self.local, self.hierarchical = local, hierarchical
        self.turns: list[str] = []

    def claim(self, be: Any) -> bool:
        if self.local:
            self.turns.append("shm")
        return self.local

    def claim_hierarchical(self, be: Any, auto: bool = False) -> bool:
        if self.hierarchical:
            self.turns.append("hierarchical")
        return self.hierarchical

    def weighs_hierarchical(self) -> bool:
        return self.hierarchical


class FakeAuto:
    """An `auto` chooser across hosts: a ticket per call (None: one host)."""

    def __init__(self, ticket: object | None) -> None:
        self._ticket = ticket
        self.tickets = 0

    def ticket(self) -> object | None:
        self.tickets += 1
        return self._ticket


def state(shm: FakeShm | None = None, auto: FakeAuto | None = None) -> PlanState:
    return PlanState(1 << 22, None, auto, shm)  # type: ignore[arg-type]


@pytest.mark.parametrize("asked", ["ring", "tree", "naive", "direct", "mesh"])
def test_an_algorithm_asked_for_runs_whatever_the_group(asked):
    auto = FakeAuto(ticket=object())
    got = choose_all_reduce(state(FakeShm(local=True), auto), asked, NUMPY, NBYTES, 4)
    assert got == (asked, None, False, False)
    assert auto.tickets == 0  # the cost model is not asked


def test_auto_on_one_host_runs_in_shared_memory_and_takes_its_turn():
    shm = FakeShm(local=True)
    auto = FakeAuto(ticket=object())
    assert choose_all_reduce(state(shm, auto), "auto", NUMPY, NBYTES, 4) == (
        "shm",
        None,
        True,
        False,
    )
    assert shm.turns == ["shm"]
    assert auto.tickets == 0


def test_auto_across_hosts_takes_a_ticket_the_call_resolves_at_its_start():
    ticket = object()
    shm = FakeShm(hierarchical=True)
    got = choose_all_reduce(state(shm, FakeAuto(ticket)), "auto", NUMPY, NBYTES, 4)
    assert got == ("auto", ticket, False, True)  # hierarchical weighed by the model


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("nbytes", [0, 4096, 1 << 20, 16 << 20])
def test_auto_without_a_ticket_follows_the_size_table(size, nbytes):
    for auto in (None, FakeAuto(ticket=None)):
        got = choose_all_reduce(state(None, auto), "auto", NUMPY, nbytes, size)
        assert got == (by_size(nbytes, size), None, False, False)


def test_auto_in_a_group_of_one_asks_no_ticket():
    auto = FakeAuto(ticket=object())
    assert choose_all_reduce(state(None, auto), "auto", NUMPY, NBYTES, 1)[0] == "tree"
    assert auto.tickets == 0


def test_shm_asked_for_across_hosts_runs_the_ring_later_and_hierarchical_runs_where_it_can():
    assert choose_all_reduce(state(FakeShm()), "shm", NUMPY, NBYTES, 4) == (
        "shm",
        None,
        False,
        False,
    )
    shm = FakeShm(hierarchical=True)
    assert choose_all_reduce(state(shm), "hierarchical", NUMPY, NBYTES, 4) == (
        "hierarchical",
        None,
        False,
        True,
    )
    assert shm.turns == ["hierarchical"]


def test_all_reduce_choice_of_a_sub_group_is_the_size_table():
    choice = all_reduce_choice(state(), NBYTES, 3)
    assert (choice.algorithm, choice.chunk_bytes) == (by_size(NBYTES, 3), 1 << 22)
