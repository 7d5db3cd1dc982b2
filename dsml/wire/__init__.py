"""Wire layer: the envelope every message starts with, message kinds, untrusted decoding.

Imports nothing above it; pure functions and frozen data only.
"""

from .envelope import (
    MAX_ENVELOPE_BYTES,
    PROTOCOL_VERSION,
    ROW_COLLECTIVES,
    Envelope,
    Fingerprint,
    decode,
    encode,
)
from .fields import Fields
from .kinds import Kind

__all__ = [
    "MAX_ENVELOPE_BYTES",
    "PROTOCOL_VERSION",
    "ROW_COLLECTIVES",
    "Envelope",
    "Fields",
    "Fingerprint",
    "Kind",
    "decode",
    "encode",
]
