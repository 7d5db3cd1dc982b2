"""`dsml flight`'s verdict from records made up here (no processes)."""

from __future__ import annotations

from typing import Any

from dsml.communicator.flight import FORMAT
from dsml.flight import verdict


def record(rank: int, calls: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    identity = {"rank": rank, "member_id": f"m{rank}", "host": "h", "pid": 100 + rank}
    identity |= {"epoch": 1, "world_size": 3}
    base = {"format": FORMAT, "reason": "test", "dumped_at": 1.0, "identity": identity}
    return base | {"calls": calls, "receives": [], "main_thread": None} | extra


def call(cid: int, outcome: str = "ok", waiting_for: Any = None) -> dict[str, Any]:
    return {
        "kind": "all_reduce",
        "cid": cid,
        "epoch": 1,
        "bytes": 64,
        "algorithm": "ring",
        "outcome": outcome,
        "total_s": 1.0,
        "waiting_for": waiting_for,
    }


def probe(cid: int, peers: dict[int, int | None]) -> dict[str, Any]:
    missing = sorted(r for r, last in peers.items() if last is None or last < cid)
    return {
        "cid": cid,
        "missing": missing,
        "peers": {str(r): {"last_started": last, "kind": None} for r, last in peers.items()},
    }


def test_a_silent_rank_without_a_record_is_named_from_the_probes() -> None:
    timed_out = call(4, "CollectiveTimeoutError", probe(4, {1: 4, 2: None}))
    records = {0: record(0, [call(3), timed_out]), 1: record(1, [call(3), call(4, "running")])}
    found = verdict(records)
    assert found.suspects == [2]
    assert found.waiters == [0, 1]
    assert found.lines[0] == (
        "rank 2 did not answer (its loop was busy or the process hung); its last collective "
        "is unknown; ranks 0, 1 waited in #4 all_reduce for it (no flight record from rank 2)"
    )
    assert "none from rank 2" in found.lines[-1]


def test_a_rank_behind_is_named_with_its_last_call_as_the_peers_saw_it() -> None:
    timed_out = call(2, "CollectiveTimeoutError", probe(2, {1: 1, 2: 2}))
    found = verdict({0: record(0, [timed_out])})
    assert found.suspects == [1]
    assert found.lines[0].startswith("rank 1 is behind: its last collective is #1; rank 0 waited")


def test_no_verdict_when_every_last_call_ended_well() -> None:
    found = verdict({0: record(0, [call(1)]), 1: record(1, [call(1)])})
    assert found.cid is None
    assert found.lines[0] == "no rank waits in a collective; last collectives:"
