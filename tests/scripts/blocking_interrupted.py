"""Rank 0 blocks in an all_reduce that rank 1 has not called; Ctrl-C must interrupt it.

Rank 1 waits for a line on stdin before calling, so rank 0 stays blocked until the test
sends it SIGINT. Both print what happened to them.
"""

import sys
import time

import numpy as np

import dsml
import dsml.blocking

with dsml.blocking.init(timeout=60) as comm:
    x = np.ones(4)
    if comm.rank == 0:
        print("waiting", flush=True)
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
