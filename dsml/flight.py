"""Reading a job's flight records: which rank stopped where (runtime, under `dsml flight`).

Each rank of a job writes its flight record (dsml/communicator/flight.py) into the same
folder. `read_records` loads them (the latest per rank), `verdict` says in a few lines
which rank the others waited for and what it was doing:

- the *waiters* are the ranks whose last collective did not end well (running, timed out,
  aborted); the collective they waited in is the newest such call;
- the *suspects* are the ranks their probes named as missing (behind or silent), or, with
  no probe answer, the ranks not among the waiters;
- for each suspect its own record, when there is one, says what it did: a receive in
  flight, its event loop busy (a SIGUSR1 record's stack), or simply an older last call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .communicator.flight import FORMAT
from .errors import ConfigError

__all__ = ["Verdict", "read_records", "verdict"]

Record = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the records say: the lines to print and the facts behind them."""

    lines: list[str]
    cid: int | None  # the collective the waiters waited in
    kind: str | None
    waiters: list[int]
    suspects: list[int]
    ranks: dict[int, dict[str, Any]]  # per rank: what its own record says

    def as_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.lines,
            "cid": self.cid,
            "kind": self.kind,
            "waiters": self.waiters,
            "suspects": self.suspects,
            "ranks": {str(r): s for r, s in sorted(self.ranks.items())},
        }


def read_records(directory: str | Path) -> dict[int, Record]:
    """The flight records in `directory`, the latest of each rank."""
    folder = Path(directory)
    if not folder.is_dir():
        raise ConfigError(f"{folder}: no such folder (the job's DSML_FLIGHT_DIR)")
    records: dict[int, Record] = {}
    for path in sorted(folder.glob("*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # not a flight record (or being written: the .part is not read)
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            continue
        rank = record["identity"]["rank"]
        if rank not in records or record["dumped_at"] > records[rank]["dumped_at"]:
            records[rank] = record
    return records


def verdict(records: dict[int, Record]) -> Verdict:
    """Say which rank the others waited for, and what it was doing (module docstring)."""
    ranks = {rank: _summary(rec) for rank, rec in records.items()}
    if not records:
        return Verdict(["no flight records found"], None, None, [], [], ranks)
    stuck = {r: c for r, rec in records.items() if (c := _stuck_call(rec)) is not None}
    if not stuck:
        lines = ["no rank waits in a collective; last collectives:"]
        lines += [f"  rank {r}: {ranks[r]['doing']}" for r in sorted(ranks)]
        return Verdict(lines, None, None, [], [], ranks)
    cid = max(c["cid"] for c in stuck.values())
    waiters = sorted(r for r, c in stuck.items() if c["cid"] == cid)
    kind = stuck[waiters[0]]["kind"]
    seen = _peers_seen(stuck[r] for r in waiters)
    world = max(rec["identity"]["world_size"] for rec in records.values())
    suspects = sorted(
        {r for c in stuck.values() for r in (c["waiting_for"] or {}).get("missing", [])}
    )
    if not suspects:
        suspects = [r for r in range(world) if r not in waiters]
    lines = [_about(s, records.get(s), seen.get(s), waiters, cid, kind) for s in suspects]
    if not suspects:
        lines.append(f"{_ranks(waiters)} failed in #{cid} {kind}; no rank was found missing")
    missing_files = [r for r in range(world) if r not in records]
    lines.append(
        f"records: {len(records)} of {world} ranks"
        + (f" (none from {_ranks(missing_files)})" if missing_files else "")
        + "; "
        + "; ".join(f"rank {r}: {records[r]['reason']}" for r in sorted(records))
    )
    return Verdict(lines, cid, kind, waiters, suspects, ranks)


def _about(
    rank: int,
    record: Record | None,
    seen: dict[str, Any] | None,
    waiters: list[int],
    cid: int,
    kind: str,
) -> str:
    """One suspect's line (`seen`: where the waiters' probes saw it)."""
    waited = f"{_ranks(waiters)} waited in #{cid} {kind}"
    last = _last_call(record) if record is not None else None
    if last is not None:
        its_last = f"its last collective is #{last['cid']} ({_call(last)})"
    elif seen is not None and seen.get("last_started") is not None:
        said = seen["last_started"]
        its_last = f"its last collective is #{said}{_kind(seen)}"
    else:
        its_last = "its last collective is unknown"
    no_file = "" if record is not None else f" (no flight record from rank {rank})"
    receives = record["receives"] if record is not None else []
    if receives:
        r = receives[0]
        return (
            f"rank {rank} waits in recv from rank {r['peer']} (tag {r['tag']}, for "
            f"{r['waiting_s']:.1f} s) while {_ranks(waiters)} wait in collective #{cid} "
            f"{kind}; {its_last}"
        )
    main = record.get("main_thread") if record is not None else None
    silent = seen is None or seen.get("last_started") is None
    if main is not None and main["loop"] == "busy" and silent:
        return (
            f"rank {rank} did not answer (its loop was busy in {main['where']}: "
            f"{main['line'].strip()}); {its_last}; {waited} for it"
        )
    if silent and seen is not None and main is None:  # no record of its own: the probe says
        return (
            f"rank {rank} did not answer (its loop was busy or the process hung); "
            f"{its_last}; {waited} for it{no_file}"
        )
    return f"rank {rank} is behind: {its_last}; {waited} for it{no_file}"


def _summary(record: Record) -> dict[str, Any]:
    """What a rank's own record says it was doing."""
    last = _last_call(record)
    receives = record["receives"]
    main = record.get("main_thread")
    if receives:
        r = receives[0]
        doing = f"waits in recv from rank {r['peer']} (tag {r['tag']})"
    elif main is not None and main["loop"] == "busy":
        doing = f"its loop is busy in {main['where']}"
    elif last is not None:
        doing = f"last collective #{last['cid']} ({_call(last)})"
    else:
        doing = "no collective yet"
    return {
        "identity": record["identity"],
        "reason": record["reason"],
        "doing": doing,
        "last_call": last,
        "receives": receives,
        "main_thread": None if main is None else {k: main[k] for k in ("loop", "where", "line")},
    }


def _last_call(record: Record) -> dict[str, Any] | None:
    epoch = record["identity"]["epoch"]
    calls = [c for c in record["calls"] if c["epoch"] == epoch] or record["calls"]
    return calls[-1] if calls else None


def _stuck_call(record: Record) -> dict[str, Any] | None:
    """The rank's last collective if it did not end well (running or failed)."""
    last = _last_call(record)
    return last if last is not None and last["outcome"] not in ("ok", "cancelled") else None


def _peers_seen(calls: Any) -> dict[int, dict[str, Any]]:
    """Where the waiters' probes last saw each peer (an answer beats a silence)."""
    seen: dict[int, dict[str, Any]] = {}
    for call in calls:
        for rank, where in ((call["waiting_for"] or {}).get("peers") or {}).items():
            if int(rank) not in seen or where.get("last_started") is not None:
                seen[int(rank)] = where
    return seen


def _call(call: dict[str, Any]) -> str:
    what = f"{call['kind']}, {call['algorithm']}" if call["algorithm"] else call["kind"]
    return f"{what}, {call['bytes']} B, {call['outcome']} in {call['total_s']:.3f} s"


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def _kind(seen: dict[str, Any]) -> str:
    return f" ({seen['kind']})" if seen.get("kind") else ""
