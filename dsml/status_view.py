"""A registry's status reply as rows per rank, and as the text of `dsml status` (runtime).

`rows` reads the members of a status reply (dsml/membership/registry.py) with their
progress summaries (membership/live.py) into one `Row` per rank: where it is, the
collective it is in and for how long, whom it waits for, who waits for it, its calls per
second and median time split. A rank others wait for is *stuck* (marked in the text with
`<< STUCK` and on the page, dsml/status_page.py). A rank the others wait for on every
call, though each call ends, is a *straggler* (`<< STRAGGLER`): over their last calls,
the others' median wait is at least `STRAGGLER_MIN_S` and most of their call, and at
least `STRAGGLER_RATIO` times its own. `render` is the text `dsml status` and `dsml status
--watch` print; `with_marks` is the reply as `--json` and the page's `status.json` give it,
with those marks under `"marks"`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Row", "render", "rows", "with_marks"]

PARTS = ("total", "waiting", "wire", "reduce", "copy", "other")  # a summary's p50_us order
STRAGGLER_MIN_S = 1e-3  # the others' median wait per call, at least
STRAGGLER_RATIO = 4.0  # ... and this many times the straggler's own
_STRAGGLER_SAMPLE = 8  # calls each rank's median must be over


@dataclass(frozen=True, slots=True)
class Row:
    """One rank as the registry last heard of it."""

    rank: int
    member: str
    address: str
    where: str  # host:pid
    name: str  # the node label it was given, if any
    epoch: int
    beat_s: float | None  # age of its last heartbeat
    call: tuple[int, str, float] | None  # (cid, kind, running_s) of its collective now
    last: str  # its last started and finished collectives, as heartbeats say
    waits_for: list[int]  # ranks its call waits for (probed, or behind it)
    waited_by: list[int]  # ranks that wait for it
    calls_per_s: float | None
    p50_s: dict[str, float] | None  # part -> median seconds over `sampled` calls
    sampled: int
    held: int  # messages held for it (from outside the view), now
    dropped: int  # messages it dropped so far
    #: the others' median wait per call, when they wait for this rank on every call
    straggles_s: float | None = None

    @property
    def stuck(self) -> bool:
        return bool(self.waited_by)

    def doing(self) -> str:
        """`#3 all_reduce for 4.2 s`, or what it last did."""
        if self.call is not None:
            cid, kind, running_s = self.call
            return f"#{cid} {kind} for {running_s:.1f} s"
        return f"idle ({self.last})" if self.last != "-" else "-"

    @property
    def straggler(self) -> bool:
        return self.straggles_s is not None and not self.stuck

    def mark(self) -> str:
        if self.stuck:
            return f"STUCK: {_ranks(self.waited_by)} wait for it"
        if self.straggles_s is not None:
            return f"STRAGGLER: the others wait {self.straggles_s * 1e3:.1f} ms a call for it"
        return ""


def rows(status: dict[str, Any]) -> list[Row]:
    """One row per member of a status reply, in rank order."""
    members = status.get("members") or []
    waiting: dict[int, list[int]] = {m["rank"]: [] for m in members}
    for m in members:
        for waiter in m.get("waited_by") or []:
            waiting.setdefault(waiter, []).append(m["rank"])
    table = [_row(m, sorted(waiting.get(m["rank"], []))) for m in members]
    return _with_stragglers(table)


def with_marks(status: dict[str, Any]) -> dict[str, Any]:
    """The reply with `"marks"`: `{"stuck": {rank: [ranks waiting for it]}, "stragglers":
    {rank: the others' median wait per call in seconds}}` (rank keys as strings, JSON's)."""
    table = rows(status)
    marks = {
        "stuck": {str(r.rank): r.waited_by for r in table if r.stuck},
        "stragglers": {str(r.rank): r.straggles_s for r in table if r.straggler},
    }
    return {**status, "marks": marks}


def _with_stragglers(table: list[Row]) -> list[Row]:
    """Mark the ranks the others wait for on every call (module docstring)."""
    timed = [r for r in table if r.p50_s is not None and r.sampled >= _STRAGGLER_SAMPLE]
    if len(timed) < 2 or len(timed) < len(table):
        return table
    marked = {}
    for row in timed:
        others = [r.p50_s for r in timed if r is not row and r.p50_s is not None]
        wait = statistics.median(p["waiting"] for p in others)
        total = statistics.median(p["total"] for p in others)
        assert row.p50_s is not None
        own = row.p50_s["waiting"]
        if wait >= STRAGGLER_MIN_S and 2 * wait >= total and wait >= STRAGGLER_RATIO * own:
            marked[row.rank] = wait
    return [dataclasses.replace(r, straggles_s=marked.get(r.rank)) for r in table]


def _row(m: dict[str, Any], waits_for: list[int]) -> Row:
    progress = m.get("progress")
    counters = m.get("counters") or {}
    call = None
    if progress and progress.get("call"):
        cid, kind, running_s = progress["call"]
        call = (cid, kind, running_s + (m.get("heartbeat_age") or 0.0))
    if progress and progress.get("waiting_for") is not None:
        waits_for = list(progress["waiting_for"])
    p50 = None
    if progress and progress.get("sampled"):
        p50 = {part: us / 1e6 for part, us in zip(PARTS, progress["p50_us"], strict=True)}
    return Row(
        rank=m.get("rank", -1),
        member=m.get("id", ""),
        address=m.get("address", ""),
        where=f"{m.get('host', '?')}:{m.get('pid', '?')}",
        name=m.get("name") or "",
        epoch=m.get("epoch", 0),
        beat_s=m.get("heartbeat_age"),
        call=call,
        last=_last(m),
        waits_for=waits_for,
        waited_by=sorted(m.get("waited_by") or []),
        calls_per_s=progress.get("calls_per_s") if progress else None,
        p50_s=p50,
        sampled=progress.get("sampled", 0) if progress else 0,
        held=counters.get("held", 0),
        dropped=sum(v for k, v in counters.items() if k.startswith("dropped")),
    )


def render(address: str, status: dict[str, Any]) -> str:
    """The text of `dsml status`: the group, a line per rank (stuck ones marked), joiners,
    refusals, worker daemons, the recent view changes."""
    lines = [_headline(address, status)]
    table = rows(status)
    if table:
        lines.append(
            f"{'rank':>6}  {'address':<24} {'host:pid':<22} {'epoch':>5} {'beat':>6} "
            f"{'held':>5} {'dropped':>7}  {'collective now':<30} {'waits for':<9} "
            f"{'calls/s':>7}  p50 ms: total/wait/wire/reduce/copy/other"
        )
        for row in table:
            lines.append(_line(row))
    for m in status.get("joining") or []:
        lines.append(f"     -  {m['address']:<24} {m['host'] + ':' + str(m['pid']):<22} (joining)")
    for reason in status.get("refused") or []:
        lines.append(f"     -  refused {reason}")
    lines += _workers(status.get("workers") or [])
    if status.get("evicted"):
        lines.append(f"evicted: {', '.join(status['evicted'])}")
    views = status.get("views") or []
    if views:
        lines.append("recent views:")
        for v in views[-5:]:
            at = time.strftime("%H:%M:%S", time.localtime(v["at"]))
            size = f"{v['size']} member{'' if v['size'] == 1 else 's'}"
            lines.append(f"  epoch {v['epoch']} at {at}, {size}: {v['reason']}")
    return "\n".join(lines)


def _headline(address: str, status: dict[str, Any]) -> str:
    if status.get("formed") or status.get("joining"):
        state = "formed" if status.get("formed") else "forming"
        group = f"group {state}, epoch {status.get('epoch')}, world size {status.get('world_size')}"
    else:
        epoch = status.get("epoch")
        group = f"no group running (the last one's epoch: {epoch})" if epoch else "no group yet"
    return (
        f"registry {address}: {group}, "
        f"{status.get('dropped_messages', 0)} malformed messages dropped"
    )


def _line(row: Row) -> str:
    beat = f"{row.beat_s:.1f}s" if row.beat_s is not None else "-"
    rate = f"{row.calls_per_s:.1f}" if row.calls_per_s is not None else "-"
    split = "-"
    if row.p50_s is not None:
        split = "/".join(f"{row.p50_s[p] * 1e3:.2f}" for p in PARTS)
    waits = ",".join(str(r) for r in row.waits_for) or "-"
    mark = f"  << {row.mark()}" if row.mark() else ""
    name = f"  {row.name}" if row.name else ""
    return (
        f"{'*' if row.stuck else '~' if row.straggler else ' '} {row.rank:>4}  "
        f"{row.address:<24} {row.where:<22} "
        f"{row.epoch:>5} {beat:>6} {row.held:>5} {row.dropped:>7}  {row.doing():<30} "
        f"{waits:<9} {rate:>7}  {split}{name}{mark}"
    )


def _last(m: dict[str, Any]) -> str:
    """`last #2 all_reduce` from a heartbeat's [epoch, cid, description]s, or '-'."""
    started, finished = m.get("started"), m.get("finished")
    if not started:
        return "-"
    text = f"last #{started[1]} {started[2].split('(')[0].strip()}"
    if finished and finished[:2] != started[:2]:
        text += f", finished #{finished[1]}"
    return text


def _workers(workers: list[dict[str, Any]]) -> list[str]:
    if not workers:
        return []
    idle = sum(1 for w in workers if w.get("state") == "idle")
    lines = [
        f"worker daemons: {idle} idle, {len(workers) - idle} busy",
        f"  {'name':<16} {'state':<5} {'address':<24} {'host:pid':<22} {'device':<7} "
        f"{'beat':>6} {'jobs':>5}",
    ]
    for w in workers:
        age = w.get("heartbeat_age")
        beat = f"{age:.1f}s" if isinstance(age, int | float) else "-"
        job = f"  job {w['job']}" if w.get("job") else ""
        lines.append(
            f"  {w['name']:<16} {w['state']:<5} {w['address']:<24} "
            f"{w['host'] + ':' + str(w['pid']):<22} {w['device']:<7} {beat:>6} "
            f"{w.get('jobs_done', 0):>5}{job}"
        )
    return lines


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)
