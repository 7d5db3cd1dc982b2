"""Slurm host lists such as `n[01-04,07],gpu3`, expanded without `scontrol` (launch layer)."""

from __future__ import annotations

from ..errors import ConfigError

__all__ = ["expand_hostlist"]

_MAX_HOSTS = 1 << 16  # a typo like n[1-99999999] must not exhaust memory


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm host list into host names, in order.

    Commas outside brackets separate entries; each bracket holds comma-separated numbers
    or ranges (`01-04` keeps the zero padding of its lower bound, as Slurm does), and a
    name may have several brackets (`r[1-2]n[1-2]` gives r1n1 r1n2 r2n1 r2n2).

    Raises:
        ConfigError: unbalanced brackets, a bad range, or more than 65536 hosts.
    """
    hosts: list[str] = []
    for entry in _split_top_level(text):
        hosts += _expand_entry(entry, text)
        if len(hosts) > _MAX_HOSTS:
            raise ConfigError(f"host list {text!r} names more than {_MAX_HOSTS} hosts")
    if not hosts:
        raise ConfigError(f"host list {text!r} names no host")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split at the commas that are not inside brackets."""
    entries, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth not in (0, 1):
            raise ConfigError(f"host list {text!r} has unbalanced brackets")
        if char == "," and depth == 0:
            entries.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ConfigError(f"host list {text!r} has unbalanced brackets")
    entries.append(text[start:])
    return [e.strip() for e in entries if e.strip()]


def _expand_entry(entry: str, text: str) -> list[str]:
    """`n[01-02]x[1,3]` -> n01x1 n01x3 n02x1 n02x3 (the first bracket varies slowest)."""
    open_at = entry.find("[")
    if open_at < 0:
        if "]" in entry:
            raise ConfigError(f"host list {text!r} has unbalanced brackets")
        return [entry]
    close_at = entry.index("]", open_at)
    prefix, rest = entry[:open_at], entry[close_at + 1 :]
    tails = _expand_entry(rest, text) if rest else [""]
    return [
        prefix + number + tail
        for number in _numbers(entry[open_at + 1 : close_at], text)
        for tail in tails
    ]


def _numbers(spec: str, text: str) -> list[str]:
    numbers: list[str] = []
    for part in spec.split(","):
        low, sep, high = part.strip().partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ConfigError(f"host list {text!r}: cannot read range {part!r}")
        if not sep:
            numbers.append(low)
            continue
        first, last = int(low), int(high)
        if last < first or last - first >= _MAX_HOSTS:
            raise ConfigError(f"host list {text!r}: bad range {part!r}")
        numbers += [str(n).zfill(len(low)) for n in range(first, last + 1)]
    return numbers
