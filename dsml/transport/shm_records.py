"""Entry records in a shared-memory control segment (transport layer).

The first sync of every call carries a record per rank: the collective id, whether the
rank found room for its data, the generation of its data segment for this call, and the
call's fingerprint (its wire bytes; a 32-byte digest when longer than fits). Two slots
alternate between calls (`ShmLink.begin` decides when one may be reused); readers find a
call's record by its collective id.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["RECORD_AT", "Record", "find_record", "write_record"]

RECORD_BYTES = 512
RECORD_AT = (128, 640)  # byte offsets of the two slots in the control segment's header
_HEAD = 32  # int64 cid, ok, fingerprint length, data generation
FP_MAX = RECORD_BYTES - _HEAD


@dataclass(frozen=True, slots=True)
class Record:
    cid: int
    ok: bool
    fingerprint: bytes
    gen: int


def write_record(buffer: Any, slot: int, record: Record) -> None:
    """Write a record into a slot (the cid last, so a reader never sees it half done)."""
    fingerprint = record.fingerprint
    if len(fingerprint) > FP_MAX:
        fingerprint = b"#" + hashlib.blake2b(fingerprint, digest_size=32).digest()
    at = RECORD_AT[slot]
    raw = np.frombuffer(buffer, np.uint8)
    raw[at + _HEAD : at + _HEAD + len(fingerprint)] = np.frombuffer(fingerprint, np.uint8)
    head = raw[at : at + _HEAD].view(np.int64)
    head[1], head[2], head[3] = int(record.ok), len(fingerprint), record.gen
    head[0] = record.cid


def find_record(buffer: Any, cid: int) -> tuple[int, Record] | None:
    """(slot, record) of call cid in a control segment, or None."""
    raw = np.frombuffer(buffer, np.uint8)
    for slot, at in enumerate(RECORD_AT):
        head = raw[at : at + _HEAD].view(np.int64)
        if int(head[0]) == cid:
            length = min(int(head[2]), FP_MAX + 1)
            fingerprint = raw[at + _HEAD : at + _HEAD + length].tobytes()
            return slot, Record(cid, bool(head[1]), fingerprint, int(head[3]))
    return None
