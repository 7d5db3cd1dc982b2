"""Members and views: who is in the group, in which ring order, at which epoch (membership).

A `View` is immutable. Every change of membership makes a new view with a higher epoch;
rank r is the member at position r of the ring. Messages carry the epoch of the view they
were sent in, so receivers can drop what belongs to an older group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, ProtocolError
from ..transport import check_address
from ..wire import Fields

__all__ = ["Change", "Member", "View"]


@dataclass(frozen=True, slots=True)
class Member:
    """One worker: a unique id, the address its endpoint serves on, and where it runs."""

    id: str
    address: str
    name: str = ""
    host: str = ""
    pid: int = 0
    #: boot id and /dev/shm device (`dsml.transport.shm_segment.host_identity`): members
    #: with equal `host` and `host_id` share memory; empty when shared memory is off
    host_id: str = ""
    #: the largest payload frame it accepts (`CommConfig.max_frame_bytes`; 0: not said):
    #: senders keep the chunks they choose within every member's
    max_frame: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "address": self.address,
            "name": self.name,
            "host": self.host,
            "pid": self.pid,
            "host_id": self.host_id,
            "max_frame": self.max_frame,
        }

    @classmethod
    def from_wire(cls, fields: Fields) -> Member:
        return cls(
            id=fields.get_str("id", 64),
            address=fields.get_str("address", 512),
            name=fields.get_str("name", 256),
            host=fields.get_str("host", 256),
            pid=fields.get_int("pid", 0, 1 << 31),
            host_id=fields.get_str("host_id", 128, optional=True) or "",
            max_frame=fields.get_int("max_frame", 0, 1 << 62, optional=True) or 0,
        )

    def describe(self) -> str:
        label = f"{self.name} " if self.name else ""
        return f"{label}{self.host}:{self.pid} at {self.address}"


@dataclass(frozen=True, slots=True)
class View:
    """The group at one epoch: members in ring order (rank = position)."""

    epoch: int
    members: tuple[Member, ...]

    @property
    def size(self) -> int:
        return len(self.members)

    def rank_of(self, member_id: str) -> int | None:
        """Rank of a member id, or None when it is not in this view."""
        for rank, member in enumerate(self.members):
            if member.id == member_id:
                return rank
        return None

    def to_wire(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "members": [m.to_wire() for m in self.members]}

    @classmethod
    def from_wire(cls, fields: Fields) -> View:
        members = tuple(Member.from_wire(f) for f in fields.map_list("members"))
        for member in members:
            try:
                check_address(member.address, "member address")
            except ConfigError as exc:
                raise ProtocolError(f"a view lists a bad address: {exc}") from None
        if not members:
            raise ProtocolError("a view needs at least one member")
        if len({m.id for m in members}) != len(members):
            raise ProtocolError("a view lists a member twice")
        return cls(epoch=fields.get_int("epoch", 1), members=members)

    def __repr__(self) -> str:
        return f"View(epoch={self.epoch}, size={self.size})"


@dataclass(frozen=True, slots=True)
class Change:
    """Why a view replaced the previous one, sent with it.

    `boundary` is set when the change was agreed with the members (joiners admitted):
    collectives numbered below it still run in epoch `previous`, the one numbered
    `boundary` is the first of the new view. Without a boundary the previous epoch is over
    at once: members were `lost` (died, evicted) or `left` (with the number of their last
    collective), and every call of that epoch that needs them fails.
    """

    previous: int = 0
    boundary: int | None = None
    lost: tuple[str, ...] = ()
    left: tuple[tuple[str, int], ...] = ()
    #: the epoch each `left` member's last collective is numbered in (the last view it
    #: entered); a member that enters a newer view than that took part in none of its calls
    left_epochs: tuple[tuple[str, int], ...] = ()
    joined: tuple[str, ...] = ()
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0

    def to_wire(self) -> dict[str, Any]:
        return {
            "previous": self.previous,
            "boundary": self.boundary,
            "lost": list(self.lost),
            "left": [[member, last] for member, last in self.left],
            "left_epochs": [[member, epoch] for member, epoch in self.left_epochs],
            "joined": list(self.joined),
            "heartbeat_interval": self.heartbeat_interval,
            "heartbeat_timeout": self.heartbeat_timeout,
        }

    @classmethod
    def from_wire(cls, fields: Fields) -> Change:
        left = _id_int_pairs(fields.get_list("left", 1 << 16), "left", "last collective")
        older = fields.get_list("left_epochs", 1 << 16, optional=True) or []  # older: none
        left_epochs = _id_int_pairs(older, "left_epochs", "epoch")
        return cls(
            previous=fields.get_int("previous", 0),
            boundary=fields.get_int("boundary", 1, optional=True),
            lost=tuple(fields.get_str_list("lost")),
            left=left,
            left_epochs=left_epochs,
            joined=tuple(fields.get_str_list("joined")),
            heartbeat_interval=fields.get_float("heartbeat_interval", 1e-3, 3600.0),
            heartbeat_timeout=(
                fields.get_float("heartbeat_timeout", 2e-3, 36000.0)
                if fields.has("heartbeat_timeout")
                else 10.0
            ),
        )


def _id_int_pairs(items: list[Any], key: str, what: str) -> tuple[tuple[str, int], ...]:
    """A wire list of [member id, integer] pairs, checked."""
    pairs = []
    for item in items:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not isinstance(item[0], str)
            or type(item[1]) is not int
        ):
            raise ProtocolError(f"ViewChanged.{key} must list [member id, {what}]")
        pairs.append((item[0], item[1]))
    return tuple(pairs)
