"""Splitting element ranges into segments and chunks: pure functions, checked exhaustively."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dsml.collectives.chunking import chunk_spans, split_spans


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
def test_split_spans_cuts_exactly_like_numpy_array_split(parts):
    for count in range(0, 30):
        expected = [len(a) for a in np.array_split(np.arange(count), parts)]
        spans = split_spans(count, parts)
        assert [hi - lo for lo, hi in spans] == expected
        assert spans[0][0] == 0
        assert spans[-1][1] == count
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


def test_split_spans_in_units_keeps_whole_rows():
    spans = split_spans(7 * 3, 3, unit=3)
    assert [hi - lo for lo, hi in spans] == [9, 6, 6]
    assert all(lo % 3 == 0 and hi % 3 == 0 for lo, hi in spans)


@pytest.mark.parametrize("chunk", [1, 2, 5, 64])
def test_chunk_spans_cover_the_span_in_pieces_no_larger_than_a_chunk(chunk):
    for lo, hi in [(0, 1), (3, 17), (10, 10 + chunk), (0, 200)]:
        pieces = chunk_spans((lo, hi), chunk)
        assert pieces[0][0] == lo
        assert pieces[-1][1] == hi
        assert all(0 < b - a <= chunk for a, b in pieces)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))


def test_an_empty_span_still_gives_one_empty_chunk():
    assert chunk_spans((5, 5), 8) == [(5, 5)]
