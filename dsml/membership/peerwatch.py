"""Peers watching each other on the data links (membership layer, pure logic).

The registry's heartbeats say who is alive while the registry is reachable. Without it,
the members must notice deaths themselves: every message from a peer counts as a sign of
life, and a member whose link to a watched peer carried nothing for `interval` sends it a
small `PeerBeat`. A watched peer not heard from for longer than `timeout` (the registry's
heartbeat timeout) is silent: stopped, cut off, or dead without its connection dropping.

Who watches whom is a fixed overlay, so that the beats a member sends and checks do not
grow with the group (`overlay`): its `OVERLAY_K` ring successors and as many
predecessors, a symmetric relation (a member watches exactly those that watch it), which
is every peer in a view of up to 2k + 1 members. A kill -9 needs no watcher: every member
keeps a connection to every peer, and each sees it drop (the transport's monitor). A
member may also watch a peer outside its overlay for the rest of a view (`add`): one it
must hear from to agree on a view without the registry, or one that beats it (it watches
back, so a peer that watches this member is heard from in turn).

`PeerWatch` keeps the times; the communicator feeds it and asks it. Like the registry's
watchdog, it credits its own stalls (the member's loop did not run) to every peer, so a
busy member does not blame the others for its own pause.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["OVERLAY_K", "PeerWatch", "overlay"]

#: ring successors (and predecessors) each member watches
OVERLAY_K = 3


def overlay(size: int, rank: int, k: int = OVERLAY_K) -> list[int]:
    """The ranks rank `rank` of a view of `size` watches: k successors and k predecessors
    on the ring (every other rank when size <= 2k + 1), nearest first."""
    ranks: list[int] = []
    for step in range(1, min(k, size - 1) + 1):
        for peer in ((rank + step) % size, (rank - step) % size):
            if peer != rank and peer not in ranks:
                ranks.append(peer)
    return ranks


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

    def add(self, peers: Iterable[str], now: float) -> list[str]:
        """Watch these peers too, until the next `reset`, each as just heard (a full
        timeout from now) and due a beat; returns those not watched before."""
        new = [p for p in peers if p not in self.last_heard]
        for peer in new:
            self.last_heard[peer] = now
            self.last_sent[peer] = float("-inf")
        return new

    def watches(self, peer: str) -> bool:
        return peer in self.last_heard

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
