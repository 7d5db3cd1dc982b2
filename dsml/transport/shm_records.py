"""Entry records in a shared-memory control segment (transport layer).

The first sync of every call carries a record per rank: the collective id, whether the
rank found room for its data, the generation of its data segment for this call, and the
call's fingerprint (its wire bytes; a 32-byte digest when longer than fits). Two slots
alternate between calls (`ShmLink.begin` decides when one may be reused); readers find a
call's record by its collective id.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any, NamedTuple

__all__ = ["FP_MAX", "RECORD_AT", "Record", "find_record", "write_cid", "write_record"]

RECORD_BYTES = 512
RECORD_AT = (128, 640)  # byte offsets of the two slots in the control segment's header
_HEAD = 32  # int64 cid, ok, fingerprint length, data generation
FP_MAX = RECORD_BYTES - _HEAD
# Native int64s ('@'): struct copies each whole, so a peer never reads a cid half written
# (the standard sizes, '<' or '=', are written byte by byte). Offsets are 8-aligned.
_CID = struct.Struct("@q")
_REST = struct.Struct("@qqq")  # ok, fingerprint length, data generation


class Record(NamedTuple):
    """One rank's entry record (a tuple: made on every call, so cheap to build)."""

    cid: int
    ok: bool
    fingerprint: bytes
    gen: int


def write_record(buffer: Any, slot: int, record: Record) -> None:
    """Write a record into a slot (the cid last, so a reader never sees it half done).

    `buffer` is a writable buffer (a control segment's bytes)."""
    fingerprint = record.fingerprint
    if len(fingerprint) > FP_MAX:
        fingerprint = b"#" + hashlib.blake2b(fingerprint, digest_size=32).digest()
    at = RECORD_AT[slot]
    memoryview(buffer)[at + _HEAD : at + _HEAD + len(fingerprint)] = fingerprint
    _REST.pack_into(buffer, at + 8, int(record.ok), len(fingerprint), record.gen)
    _CID.pack_into(buffer, at, record.cid)


def write_cid(buffer: Any, slot: int, cid: int) -> None:
    """Write only the cid of a slot whose other fields already hold the record (a
    repeated call: same fingerprint, room and data generation as the slot's last)."""
    _CID.pack_into(buffer, RECORD_AT[slot], cid)


def find_record(buffer: Any, cid: int, first: int = 0) -> tuple[int, Record] | None:
    """(slot, record) of call cid in a control segment, or None; looks at slot `first`
    first (where the caller expects it)."""
    for slot in (first, 1 - first):
        at = RECORD_AT[slot]
        if _CID.unpack_from(buffer, at)[0] == cid:  # read first: the writer writes it last
            ok, length, gen = _REST.unpack_from(buffer, at + 8)
            length = min(length, FP_MAX + 1)
            fingerprint = bytes(memoryview(buffer)[at + _HEAD : at + _HEAD + length])
            return slot, Record(cid, bool(ok), fingerprint, gen)
    return None
