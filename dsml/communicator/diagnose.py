"""Error messages that say what happened, on which ranks, and what to do (communicator).

Aborts carry a reason and a ready-made message from the rank that detected the problem,
so every rank raises the same explanation; `error_from_abort` rebuilds the right
exception type on the receiving side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import (
    CollectiveAbortedError,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
)
from ..wire import Envelope, Fields, Fingerprint
from .waiting import WaitingFor

__all__ = [
    "abort_body",
    "error_from_abort",
    "goodbye_message",
    "mismatch_message",
    "still_waiting_message",
    "timeout_message",
]

_ADVICE = (
    "Every rank must make the same collective calls, in the same order, with matching arguments."
)


def mismatch_message(cid: int, a: int, a_fp: Fingerprint, b: int, b_fp: Fingerprint) -> str:
    conflicts = a_fp.conflicts(b_fp)
    differing = ", ".join(conflicts) or "call"
    advice = _ADVICE
    if conflicts == ["chunk_bytes"]:
        advice = (
            f"CommConfig.chunk_bytes must be the same on every rank (rank {a}: "
            f"{a_fp.chunk_bytes}, rank {b}: {b_fp.chunk_bytes})."
        )
    return (
        f"collective #{cid} does not match across ranks: rank {a} called {a_fp.describe()} "
        f"but rank {b} called {b_fp.describe()} (different {differing}). {advice}"
    )


def goodbye_message(cid: int, fp: Fingerprint, me: int, peer: int, last: int) -> str:
    return (
        f"collective #{cid} {fp.describe()} failed on rank {me}: rank {peer} left the group "
        f"(closed its communicator) after collective #{last}. Inputs are unchanged. The next "
        "call runs in the view without it (restore and re-synchronise state first: "
        "dsml.elastic does it). If rank "
        f"{peer} was not meant to leave yet, it made fewer calls than rank {me}"
    )


def timeout_message(
    fp: Fingerprint, me: int, seconds: float, waiting: WaitingFor
) -> tuple[str, list[int]]:
    """Message and missing ranks of a timeout, from the peers' answers to the probe."""
    cid, silent, behind = waiting.cid, waiting.silent(), waiting.behind()
    parts = [
        f"rank {r} has not arrived (its last collective is #{last})" for r, last in behind.items()
    ]
    if silent:
        parts.append(f"rank{'s' if len(silent) > 1 else ''} {_join(silent)} did not answer")
    if not parts:
        parts.append("every rank has arrived, but the data did not flow in time")
    missing = waiting.missing()
    advice = (
        "check that those ranks reach this call (a missing call, an exception, a hang)"
        if missing
        else f"raise timeout= above {seconds:g} s, or check the network"
    )
    message = (
        f"collective #{cid} {fp.describe()} timed out after {seconds:g} s on rank {me}: "
        f"{'; '.join(parts)}. {advice[0].upper()}{advice[1:]}."
    )
    return message, missing


#: How many late ranks a progress line names before "and N more".
NAMED_LATE = 4


def still_waiting_message(kind: str, elapsed: float, waiting: WaitingFor) -> str:
    """The progress log's line: `still waiting after 5.0 s in barrier (collective #1) for
    rank 1 (last seen at collective #0)`; the peers named are the missing ones only."""
    where = f"still waiting after {elapsed:.1f} s in {kind} (collective #{waiting.cid})"
    missing = waiting.missing()
    if not missing:
        return f"{where}: every rank has arrived; its data is still in flight"
    named = [
        f"rank {r} (did not answer)"
        if waiting.started[r] is None
        else f"rank {r} (last seen at {waiting.last_seen(r)})"
        for r in missing[:NAMED_LATE]
    ]
    more = len(missing) - len(named)
    listed = ", ".join(named) + (f" and {more} more" if more else "")
    return f"{where} for {listed}"


def _join(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


#: Longest message an Abort carries (receivers refuse longer ones).
MAX_MESSAGE = 8192


def abort_body(reason: str, message: str, origin: int, ranks: Sequence[int] = ()) -> dict[str, Any]:
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 3] + "..."
    return {"reason": reason, "message": message, "origin": origin, "ranks": list(ranks)}


def error_from_abort(
    env: Envelope, mine: Fingerprint, me: int, *, late: bool = False
) -> CollectiveError:
    """The exception this rank raises for an Abort received for its call `mine`.

    `late` means the abort arrived before this rank even made the call.
    """
    fields = Fields(env.body, "Abort")
    reason = fields.get_str("reason", 32)
    message = fields.get_str("message", MAX_MESSAGE)
    origin = fields.get_int("origin", 0, 1 << 20)
    ranks = fields.int_list("ranks", 0, 1 << 20)
    where: dict[str, Any] = {
        "rank": me,
        "epoch": env.epoch,
        "cid": env.cid,
        "collective": mine.collective,
    }
    theirs = env.fingerprint
    if reason == "mismatch":
        return CollectiveMismatchError(message, ranks=ranks, **where)
    if reason == "timeout":
        if late:
            message = (
                f"rank {me} arrived at collective #{env.cid} too late: rank {origin} had "
                f"already timed out and given it up. Rank {origin} reported: {message}"
            )
            ranks = ranks or [me]
        return CollectiveTimeoutError(message, missing=ranks, **where)
    if theirs is not None and mine.conflicts(theirs) and reason != "skipped":
        text = mismatch_message(env.cid, me, mine, origin, theirs)
        return CollectiveMismatchError(
            f"{text} Rank {origin} reported: {message}", ranks=(me, origin), **where
        )
    return CollectiveAbortedError(
        f"collective #{env.cid} {mine.describe()} was abandoned by rank {origin}: {message}",
        origin=origin,
        **where,
    )
