"""Rank 0 blocks in an all_reduce that rank 1 has not called; Ctrl-C must interrupt it.

Rank 1 waits for a line on stdin before calling, so rank 0 stays blocked until the test
sends it SIGINT. Both print what happened to them.
"""

import sys
import threading
import time

import numpy as np

import dsml
import dsml.blocking


def in_the_wait(thread_id: int) -> bool:
    """Is that thread blocked in Handle.wait's wait_done() (inside its try)?"""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "wait_done" and code.co_filename.endswith("blocking_loop.py"):
            return True
        frame = frame.f_back
    return False


def say_waiting_once_in_the_wait(thread_id: int) -> None:
    """Print "waiting" only once the main thread is in the wait, so the test's SIGINT
    lands there however long a busy machine takes to get it there (a sleep would guess)."""
    while not in_the_wait(thread_id):
        time.sleep(0.005)
    print("waiting", flush=True)


with dsml.blocking.init(timeout=60) as comm:
    x = np.ones(4)
    if comm.rank == 0:
        main = threading.get_ident()
        threading.Thread(target=say_waiting_once_in_the_wait, args=(main,), daemon=True).start()
        started = time.monotonic()
        try:
            comm.all_reduce(x)
            print("not interrupted", flush=True)
        except KeyboardInterrupt:
            print(f"interrupted after {time.monotonic() - started:.3f} s", flush=True)
            assert x.tolist() == [1.0] * 4  # input intact
            comm.barrier(timeout=30)  # still usable: both ranks take the next call
            print("usable", flush=True)
    else:
        print("ready", flush=True)
        sys.stdin.readline()
        try:
            comm.all_reduce(x)
            print("peer: no error", flush=True)
        except dsml.DsmlError as exc:
            print(f"peer: {type(exc).__name__}", flush=True)
        comm.barrier(timeout=30)
        print("usable", flush=True)
