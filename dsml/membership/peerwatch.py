"""Peers watching each other on the data links (membership layer, pure logic).

The registry's heartbeats say who is alive while the registry is reachable. Without it,
the members must notice deaths themselves: every message from a peer counts as a sign of
life, and a member whose link to a peer carried nothing for `interval` sends it a small
`PeerBeat`. A peer heard from for longer than `timeout` (the registry's heartbeat timeout)
is silent: stopped, cut off, or dead without its connection dropping.

`PeerWatch` keeps the times; the communicator feeds it and asks it. Like the registry's
watchdog, it credits its own stalls (the member's loop did not run) to every peer, so a
busy member does not blame the others for its own pause.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["PeerWatch"]


@dataclass(slots=True)
class PeerWatch:
    """Last signs of life from, and to, each peer; see the module docstring."""

    interval: float
    timeout: float
    last_heard: dict[str, float] = field(default_factory=dict)
    last_sent: dict[str, float] = field(default_factory=dict)

    def reset(self, peers: Iterable[str], now: float) -> None:
        """Watch these peers (a new view): everyone starts as just heard."""
        peers = list(peers)
        self.last_heard = dict.fromkeys(peers, now)
        self.last_sent = {p: self.last_sent.get(p, float("-inf")) for p in peers}

    def heard(self, peer: str, now: float) -> None:
        if peer in self.last_heard:
            self.last_heard[peer] = now

    def sent(self, peer: str, now: float) -> None:
        if peer in self.last_sent:
            self.last_sent[peer] = now

    def due(self, now: float) -> list[str]:
        """Peers this member sent nothing to for `interval`: send them a beat (and call
        `sent`)."""
        return [p for p, t in self.last_sent.items() if now - t >= self.interval]

    def silent(self, now: float) -> list[str]:
        """Peers not heard from for longer than `timeout`."""
        return [p for p, t in self.last_heard.items() if now - t > self.timeout]

    def credit(self, late: float) -> None:
        """This member did not run for `late` seconds: that silence is not the peers'."""
        for peer in self.last_heard:
            self.last_heard[peer] += late

    def __repr__(self) -> str:
        return (
            f"PeerWatch(peers={len(self.last_heard)}, beat every {self.interval:g} s, "
            f"silent after {self.timeout:g} s)"
        )
