"""Moving an array between a device and a pinned host twin, chunk by chunk (collectives layer).

cupy arrays reach the network through host memory: ZeroMQ sends and receives bytes in
RAM. This module is the pipeline logic, written against `StagedCopies`, a small protocol
that `cuda.py` implements with cupy (copies on a CUDA stream of dsml's own) and tests
implement with numpy, recording the order of operations.

What must stay true:

* `after_caller` comes first: the copy stream waits for the work already queued on the
  caller's stream when the collective was called, so the user never synchronises by hand.
* Downloads are all queued at once, as soon as the call is planned, so chunk k+1 comes off
  the device while chunk k is waited for and used; they complete in queue order.
* Uploads (writing a result into the caller's array) are all queued before the first
  wait, and only after the collective succeeded: a failed call never touches the caller's
  array, and a caller who cancels while the upload is waited for still gets a whole result,
  never half of one.
* On a failure path `drain` waits (blocking) for queued copies before the host buffer can
  be freed, because a DMA engine may still be writing into it.
"""

from __future__ import annotations

from typing import Protocol

from .chunking import Span, chunk_spans

__all__ = ["Download", "StagedCopies", "upload"]


class StagedCopies(Protocol):
    """Copies between one device array (seen flat) and its host twin, queued in order."""

    def after_caller(self) -> None:
        """Order every later copy after the work queued so far on the caller's stream."""
        ...

    def to_host(self, lo: int, hi: int) -> object:
        """Queue device[lo:hi] -> host[lo:hi]; returns a token for `wait`."""
        ...

    def to_device(self, lo: int, hi: int) -> object:
        """Queue host[lo:hi] -> device[lo:hi] (into a contiguous staging area)."""
        ...

    def commit(self) -> object:
        """Queue what makes the caller's array hold the uploaded result (for a strided
        array: one copy from the contiguous staging area); returns a token."""
        ...

    async def wait(self, token: object) -> None:
        """Return once the copy of `token`, and every copy queued before it, is done."""
        ...

    def drain(self) -> None:
        """Block until every queued copy is done (failure paths only)."""
        ...


class Download:
    """The device array's contents arriving in the host twin, queued at construction."""

    def __init__(self, copies: StagedCopies, count: int, chunk_elems: int) -> None:
        copies.after_caller()
        self._copies = copies
        self._queued: list[tuple[Span, object]] = [
            ((lo, hi), copies.to_host(lo, hi)) for lo, hi in chunk_spans((0, count), chunk_elems)
        ]
        self._arrived = 0

    @property
    def arrived(self) -> int:
        """Chunks known to be on the host."""
        return self._arrived

    async def next_chunk(self) -> Span | None:
        """Wait for the next chunk in order; None once all have arrived."""
        if self._arrived == len(self._queued):
            return None
        span, token = self._queued[self._arrived]
        await self._copies.wait(token)
        self._arrived += 1
        return span

    async def wait(self) -> None:
        """Wait until the whole array is on the host."""
        while await self.next_chunk() is not None:
            pass

    def abandon(self) -> None:
        """Give the download up (the call failed): block until no copy writes any more."""
        if self._arrived < len(self._queued):
            self._copies.drain()


async def upload(copies: StagedCopies, count: int, chunk_elems: int) -> None:
    """Write the host twin into the device array; returns once it is there."""
    for lo, hi in chunk_spans((0, count), chunk_elems):
        copies.to_device(lo, hi)
    await copies.wait(copies.commit())
