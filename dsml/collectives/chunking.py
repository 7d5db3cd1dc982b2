"""Splitting element ranges into segments and pipeline chunks (collectives layer).

Pure functions over integers. Every rank computes the same tables from the same
arguments, which is what lets a receiver check each message against what it expects.
"""

from __future__ import annotations

__all__ = ["Span", "chunk_spans", "split_spans"]

#: A half-open element range [start, stop).
Span = tuple[int, int]


def split_spans(count: int, parts: int, *, unit: int = 1) -> list[Span]:
    """Split `count` elements into `parts` spans the way `numpy.array_split` splits rows.

    With `unit` > 1 the split is over `count // unit` rows of `unit` elements each; the
    first `rows % parts` spans get one row more.
    """
    assert parts >= 1
    assert unit >= 1
    assert count % unit == 0
    rows, extra = divmod(count // unit, parts)
    spans, start = [], 0
    for index in range(parts):
        stop = start + (rows + (index < extra)) * unit
        spans.append((start, stop))
        start = stop
    return spans


def chunk_spans(span: Span, chunk_elems: int) -> list[Span]:
    """Cut a span into pieces of at most chunk_elems; an empty span gives one empty chunk.

    Keeping one chunk for empty spans means every step still sends a message, so ranks
    always exchange (and check) fingerprints, even for zero elements.
    """
    assert chunk_elems >= 1
    start, stop = span
    if stop <= start:
        return [(start, start)]
    return [(lo, min(lo + chunk_elems, stop)) for lo in range(start, stop, chunk_elems)]
