"""Flood a worker with envelopes of a future epoch from a non-member (hostile traffic).

    python tests/scripts/flood_future.py --target tcp://127.0.0.1:PORT --epoch E \
        --seconds 15 --frame-bytes 65536

Connects a DEALER socket with a random identity (not a member of any view) to the
worker's endpoint and sends CHUNK envelopes of epoch E with one payload frame each, as
fast as the socket takes them, for `--seconds`. Prints one JSON line at the end:
{"sent": n, "bytes": total payload bytes}. Used by tests/test_membership_hardening*.py.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import zmq

from dsml.transport import prove_secret
from dsml.wire import Envelope, Fingerprint, Kind, encode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--epoch", type=int, required=True)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--frame-bytes", type=int, default=64 << 10)
    args = p.parse_args()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    prove_secret(sock, f"intruder-{os.getpid()}".encode())  # DSML_SECRET of the job
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(args.target)
    payload = bytes(args.frame_bytes)
    count = args.frame_bytes // 4
    fp = Fingerprint("all_reduce", "float32", count, (count,), "sum")
    sent = 0
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        env = Envelope(Kind.CHUNK, args.epoch, 0, 1 + sent % 1000, 0, 0, fp)
        try:
            sock.send_multipart([encode(env), payload], zmq.NOBLOCK, copy=False)
            sent += 1
        except zmq.Again:
            time.sleep(0.001)
    print(json.dumps({"sent": sent, "bytes": sent * args.frame_bytes}), flush=True)
    sock.close(0)
    ctx.term()


if __name__ == "__main__":
    main()
