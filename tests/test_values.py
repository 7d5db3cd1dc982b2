"""The pickle-free value codec that carries job results (dsml.wire.values)."""

from __future__ import annotations

import enum

import ml_dtypes
import msgpack
import numpy as np
import pytest

from dsml.errors import ProtocolError
from dsml.wire.values import pack_value, unpack_value


def _roundtrip(value):
    header, frames = pack_value(value)
    return unpack_value(header, [memoryview(bytes(f)) for f in frames])


class Color(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        -(2**63),
        2**64 - 1,
        1.5,
        "text ünïcode",
        b"\x00bytes",
        [1, [2, [3]]],
        (1, (2, "x")),
        {"a": 1, 2: "b", "nested": {"t": (1,)}},
        1 + 2j,
    ],
)
def test_plain_values_roundtrip_with_their_types(value):
    result = _roundtrip(value)
    assert result == value
    assert type(result) is type(value)


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.zeros((0, 3), dtype=np.int64),
        np.array(7, dtype=np.uint16),
        np.array([True, False]),
        np.arange(6, dtype=">i4"),  # big-endian comes back native
        np.arange(10, dtype=np.float64)[::3],  # not contiguous
        np.asfortranarray(np.arange(6, dtype=np.int8).reshape(2, 3)),
        np.ones(3, dtype=ml_dtypes.bfloat16),
        np.array([1 + 1j], dtype=np.complex128),
    ],
)
def test_arrays_travel_as_raw_frames_and_come_back_equal_and_writable(array):
    header, frames = pack_value({"x": array})
    assert len(frames) == 1
    assert frames[0].nbytes == array.nbytes
    assert len(header) < 100  # the bytes are not in the header
    result = _roundtrip({"x": array})["x"]
    assert result.shape == array.shape
    assert result.dtype == array.dtype.newbyteorder("=")
    if array.dtype == ml_dtypes.bfloat16:
        array, result = array.astype(np.float32), result.astype(np.float32)
    np.testing.assert_array_equal(result, array)
    result[...] = 0  # a new, writable array


def test_numpy_scalars_and_subclasses_of_plain_types():
    result = _roundtrip([np.float32(1.5), np.int64(3), Color.RED])
    assert result[0] == np.float32(1.5)
    assert result[0].dtype == np.float32
    assert result[1].dtype == np.int64
    assert result[2] == 1
    assert type(result[2]) is int


@pytest.mark.parametrize(
    "value", [object(), {1, 2}, np.array([object()]), lambda: 0, np.zeros(2, dtype="V4")]
)
def test_unsupported_values_raise_a_type_error_naming_the_type(value):
    with pytest.raises(TypeError, match="cannot be sent"):
        pack_value(value)


def _ext(code, payload):
    return msgpack.packb(msgpack.ExtType(code, msgpack.packb(payload)))


@pytest.mark.parametrize(
    ("header", "frames", "match"),
    [
        (b"\xc1", [], "malformed"),
        (_ext(99, 1), [], "unknown value extension"),
        (_ext(1, [0, "float32", [2]]), [], "missing"),
        (_ext(1, [0, "float32", [2]]), [memoryview(b"\0" * 7)], "does not hold"),
        (_ext(1, [0, "object", [1]]), [memoryview(b"\0" * 8)], "dtype"),
        (_ext(1, [0, "no-such-dtype", [1]]), [memoryview(b"\0" * 8)], "dtype"),
        (_ext(1, [0, "uint8", [-1]]), [memoryview(b"")], "shape"),
        (msgpack.packb(1), [memoryview(b"x")], "did not use"),
        (_ext(3, ["float64", b"\0"]), [], "wrong size"),
        (_ext(4, ["a", 1]), [], "complex"),
    ],
)
def test_malformed_input_raises_protocol_error_only(header, frames, match):
    with pytest.raises(ProtocolError, match=match):
        unpack_value(header, frames)


def test_the_same_frame_cannot_back_two_arrays():
    spec = msgpack.ExtType(1, msgpack.packb([0, "uint8", [1]]))
    header = msgpack.packb([spec, spec])
    with pytest.raises(ProtocolError, match="used twice"):
        unpack_value(header, [memoryview(b"x")])


def test_nesting_is_bounded_both_ways():
    value = None
    for i in range(31):
        value = (i, value)
    assert _roundtrip(value)[0] == 30
    with pytest.raises(TypeError, match="more than 32 deep"):
        pack_value((0, value))
    header = msgpack.packb(None)
    for _ in range(200):  # what a hostile worker could send: must not crash the client
        header = msgpack.packb(msgpack.ExtType(2, msgpack.packb([1]) + header))
    with pytest.raises(ProtocolError):
        unpack_value(header, [])
