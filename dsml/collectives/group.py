"""The small interface every algorithm is written against (collectives layer).

An algorithm sees a `Group`: its rank, the group size, the pipeline chunk size, and
`send`/`recv` to a peer rank for a numbered step and chunk. The communicator implements it
for one collective call: it stamps every message with the epoch, collective id and
fingerprint, checks what arrives, and turns failures into errors. Steps and chunks of one
call arrive from a given peer in the order they were sent, so `recv` names exactly the
message it expects and anything else is a protocol error.

Messages travel on one of two lanes: `DATA` for the algorithm itself and `CONFIRM` for the
agreement that rooted collectives run beside it (see `confirm.py`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["Group", "Lane", "Receipt", "Received", "chunk_elems", "wait_receipts"]


class Lane(enum.IntEnum):
    DATA = 0
    CONFIRM = 1


class Receipt(Protocol):
    """Returned by `send`: the payload buffer may be modified once `done()`."""

    def done(self) -> bool: ...

    async def wait(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Received:
    """One received message: its payload bytes (possibly empty) and optional metadata."""

    payload: memoryview
    meta: dict[str, Any] | None


class Group(Protocol):
    """What an algorithm may use; see the module docstring."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def chunk_bytes(self) -> int: ...

    async def send(
        self,
        peer: int,
        step: int,
        chunk: int = 0,
        payload: memoryview | None = None,
        *,
        meta: dict[str, Any] | None = None,
        lane: Lane = Lane.DATA,
    ) -> Receipt:
        """Queue one message to peer; returns once it is queued (not delivered)."""
        ...

    async def recv(
        self,
        peer: int,
        step: int,
        chunk: int = 0,
        *,
        nbytes: int | None = None,
        lane: Lane = Lane.DATA,
    ) -> Received:
        """The next message from peer, which must be (step, chunk) with nbytes of payload."""
        ...


async def wait_receipts(receipts: Iterable[Receipt]) -> None:
    """Wait until ZeroMQ is done with every buffer sent under these receipts."""
    for receipt in receipts:
        if not receipt.done():
            await receipt.wait()


def chunk_elems(group: Group, itemsize: int) -> int:
    """Elements per pipeline chunk for this item size (at least one)."""
    return max(1, group.chunk_bytes // max(1, itemsize))
