"""Received frames sent on as they are: no copy, nothing to track (transport layer).

The ring forwards what arrives, and writes partial sums over what arrived before sending
them on (`ArrayBackend.combine`); the transport must recognise such a buffer as the frame
it views and send that frame, which libzmq shares without a copy or a tracker.
"""

from __future__ import annotations

import numpy as np
import zmq

from dsml.collectives.arrays import NUMPY
from dsml.collectives.ops import ReduceOp
from dsml.transport.sockets import _frame_of, _zero_copy_frames

THRESHOLD = 64 * 1024


def received(values: np.ndarray) -> memoryview:
    """A payload as the reader hands it over: the buffer of a frame ZeroMQ gave us."""
    return zmq.Frame(values.tobytes()).buffer


def test_a_partial_sum_written_over_a_received_frame_is_sent_as_that_frame() -> None:
    count = THRESHOLD  # float32: 256 KiB
    payload = received(np.ones(count, dtype=np.float32))
    local = np.arange(count, dtype=np.float32)
    partial = NUMPY.combine(ReduceOp.SUM, local, 0, count, payload)
    np.testing.assert_array_equal(partial, local + 1)
    parts, tracker = _zero_copy_frames([NUMPY.payload(partial, 0, count)], THRESHOLD)
    assert parts == [payload.obj]  # the received frame itself
    assert tracker is None  # nothing of ours to wait for
    np.testing.assert_array_equal(np.frombuffer(parts[0].buffer, np.float32), local + 1)


def test_part_of_a_frame_or_an_array_of_ours_goes_as_a_tracked_frame() -> None:
    payload = received(np.ones(THRESHOLD, dtype=np.float32))
    mine = np.zeros(THRESHOLD, dtype=np.float32)
    parts, tracker = _zero_copy_frames([payload[: 2 * THRESHOLD], memoryview(mine)], THRESHOLD)
    assert all(isinstance(p, zmq.Frame) and p is not payload.obj for p in parts)
    assert tracker is not None


def test_read_only_bytes_are_reduced_into_a_new_array() -> None:
    data = memoryview(np.ones(4, dtype=np.float32).tobytes())  # read-only, as in a test group
    local = np.arange(4, dtype=np.float32)
    result = NUMPY.combine(ReduceOp.SUM, local, 0, 4, data)
    np.testing.assert_array_equal(result, local + 1)
    assert _frame_of(NUMPY.payload(result, 0, 4)) is None
