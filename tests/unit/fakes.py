"""Socket-free stand-ins for the communicator's peer links and registry client."""

from __future__ import annotations

from collections import Counter
from typing import Any

from dsml.config import CommConfig
from dsml.membership import Member, View
from dsml.transport import DONE, Sent
from dsml.wire import Envelope


def member(i: int) -> Member:
    return Member(f"m{i}", f"tcp://127.0.0.1:{40000 + i}")


def view(epoch: int, *ids: int) -> View:
    return View(epoch, tuple(member(i) for i in ids))


class FakeLinks:
    """What CallTable and ViewChanges use of PeerLinks, recording what is sent."""

    def __init__(self, member_id: str = "m0") -> None:
        self.member_id = member_id
        self.config = CommConfig()
        self.view: View | None = None
        self.rank = -1
        self.counters: Counter[str] = Counter()
        self.sent: list[tuple[int | None, Envelope]] = []
        self.announced: list[View] = []

    @property
    def epoch(self) -> int:
        return self.view.epoch if self.view is not None else 0

    @property
    def size(self) -> int:
        return self.view.size if self.view is not None else 0

    def enter(self, view: View) -> None:
        rank = view.rank_of(self.member_id)
        assert rank is not None
        self.view, self.rank = view, rank

    def announce(self, view: View) -> None:
        self.announced.append(view)

    def send_control(self, env: Envelope, peers: Any = None) -> None:
        self.sent.append((None, env))

    def try_send(self, peer: int, env: Envelope, payload: Any = ()) -> Sent:
        self.sent.append((peer, env))
        return DONE

    def kinds(self) -> list[str]:
        return [env.kind.name for _peer, env in self.sent]


class FakeRegistry:
    """What ViewChanges uses of RegistryClient, recording its answers."""

    address = "tcp://127.0.0.1:1"
    beacon = None

    def __init__(self) -> None:
        self.ready_calls: list[tuple[int, int]] = []
        self.suspects: list[tuple[str, int]] = []
        self.heartbeats = True

    def ready(self, epoch: int, next_cid: int) -> None:
        self.ready_calls.append((epoch, next_cid))

    def suspect(self, member_id: str, epoch: int) -> None:
        self.suspects.append((member_id, epoch))

    def stop_heartbeats(self) -> None:
        self.heartbeats = False
