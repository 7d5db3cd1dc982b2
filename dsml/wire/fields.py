"""Typed reads of untrusted message bodies (wire layer).

A body is a msgpack map with string keys. Every accessor checks type and range and raises
`ProtocolError` on anything else, so handlers never see an unexpected type.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ProtocolError

__all__ = ["Fields"]

_INT64_MAX = (1 << 63) - 1


class Fields:
    """Read-only, validating view of a message body."""

    __slots__ = ("_body", "_what")

    def __init__(self, body: Mapping[str, Any] | None, what: str) -> None:
        if body is None:
            body = {}
        if not isinstance(body, Mapping):
            raise ProtocolError(f"{what}: body must be a map, got {type(body).__name__}")
        self._body = body
        self._what = what

    def has(self, key: str) -> bool:
        """Whether the body has that field (for fields newer peers add)."""
        return key in self._body

    def _get(self, key: str, optional: bool) -> Any:
        if key not in self._body:
            if optional:
                return None
            raise ProtocolError(f"{self._what}: field {key!r} is missing")
        return self._body[key]

    def get_int(
        self, key: str, lo: int = 0, hi: int = _INT64_MAX, *, optional: bool = False
    ) -> Any:
        """An integer in [lo, hi] (None when optional and absent)."""
        value = self._get(key, optional)
        if value is None and optional:
            return None
        if type(value) is not int or not lo <= value <= hi:
            raise ProtocolError(f"{self._what}: field {key!r} must be an integer in [{lo}, {hi}]")
        return value

    def get_str(self, key: str, max_len: int = 1024, *, optional: bool = False) -> Any:
        """A string of at most max_len characters (None when optional and absent)."""
        value = self._get(key, optional)
        if value is None and optional:
            return None
        if type(value) is not str or len(value) > max_len:
            raise ProtocolError(f"{self._what}: field {key!r} must be a string <= {max_len} chars")
        return value

    def get_bool(self, key: str) -> bool:
        """A boolean."""
        value = self._get(key, False)
        if type(value) is not bool:
            raise ProtocolError(f"{self._what}: field {key!r} must be a boolean")
        return value

    def int_list(self, key: str, lo: int = 0, hi: int = _INT64_MAX, max_len: int = 4096) -> Any:
        """A list of at most max_len integers in [lo, hi]."""
        value = self._get(key, False)
        if not isinstance(value, list) or len(value) > max_len:
            raise ProtocolError(f"{self._what}: field {key!r} must be a list of integers")
        for item in value:
            if type(item) is not int or not lo <= item <= hi:
                raise ProtocolError(f"{self._what}: field {key!r} holds a bad integer")
        return list(value)

    def get_float(self, key: str, lo: float, hi: float) -> float:
        """A finite number in [lo, hi] (an int is accepted)."""
        value = self._get(key, False)
        if type(value) not in (int, float) or not lo <= value <= hi:
            raise ProtocolError(f"{self._what}: field {key!r} must be a number in [{lo}, {hi}]")
        return float(value)

    def get_list(self, key: str, max_len: int = 4096, *, optional: bool = False) -> Any:
        """A list of at most max_len items (items unchecked: the caller checks them)."""
        value = self._get(key, optional)
        if value is None and optional:
            return None
        if not isinstance(value, list) or len(value) > max_len:
            raise ProtocolError(f"{self._what}: field {key!r} must be a list")
        return value

    def get_str_list(self, key: str, max_len: int = 65536, item_len: int = 64) -> list[str]:
        """A list of at most max_len strings, each at most item_len characters."""
        value = self.get_list(key, max_len)
        for item in value:
            if type(item) is not str or len(item) > item_len:
                raise ProtocolError(f"{self._what}: field {key!r} holds a bad string")
        return list(value)

    def map_list(self, key: str, max_len: int = 65536) -> list[Fields]:
        """A list of maps, each returned as Fields."""
        value = self._get(key, False)
        if not isinstance(value, list) or len(value) > max_len:
            raise ProtocolError(f"{self._what}: field {key!r} must be a list of maps")
        return [Fields(item, f"{self._what}.{key}[{i}]") for i, item in enumerate(value)]

    def get_map(self, key: str) -> Fields:
        """A nested map, returned as Fields."""
        return Fields(self._get(key, False), f"{self._what}.{key}")
