"""An outsider without the job secret (tests/test_security.py).

It knows everything else (it reads the ranks' ids, addresses and epoch from DIR, as the
attack of issue 33 learned them from an unauthenticated StatusRequest) and tries: a
status request, then DEALERs carrying rank 0's identity to every other rank's endpoint
(one without credentials, one with PLAIN credentials made with the wrong secret) that
send forged Chunks for cids 1..200. It writes DIR/go once its sockets are connecting and
DIR/squatter.json with what it observed, then keeps sending until DIR/result-0.json.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import sys
import time
from pathlib import Path

import numpy as np
import zmq
from zmq.utils.monitor import parse_monitor_message

from dsml.wire import Envelope, Fingerprint, Kind, encode

FAILED = {
    int(zmq.EVENT_HANDSHAKE_FAILED_AUTH),
    int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL),
    int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL),
}


def forged_password(identity: bytes) -> bytes:
    """What a member would present, made with a secret that is not the job's."""
    key = b"not-the-secret-0000"
    return hmac.new(key, b"dsml-link-1" + identity, hashlib.sha256).hexdigest().encode()


def main(folder: Path, world: int) -> None:
    while len(list(folder.glob("rank-*.json"))) < world:
        time.sleep(0.05)
    ranks = [json.loads((folder / f"rank-{r}.json").read_text()) for r in range(world)]
    registry = ranks[0]["registry"]
    ctx = zmq.Context()
    observed = {"status_reply": False, "handshakes_failed": 0, "handshakes_ok": 0, "sent": 0}
    status = ctx.socket(zmq.DEALER)
    status.linger = 0
    status.connect(registry)
    status.send(encode(Envelope(Kind.STATUS_REQUEST)))
    victim = ranks[0]["id"].encode()
    socks, monitors = [], []
    for peer in ranks[1:]:
        for plain in (False, True):
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.sndhwm = 100_000
            sock.identity = victim
            if plain:
                sock.plain_username = victim
                sock.plain_password = forged_password(victim)
            monitors.append(sock.get_monitor_socket())
            sock.connect(peer["address"])
            socks.append(sock)
    (folder / "go").write_text("")
    fp = Fingerprint("all_reduce")  # nil fields: matches any all_reduce
    forged = np.full(4, 1000.0).tobytes()
    deadline = time.monotonic() + 90
    while not (folder / "result-0.json").exists() and time.monotonic() < deadline:
        for cid in range(1, 201):
            env = Envelope(Kind.CHUNK, ranks[0]["epoch"], cid, 1, 0, 0, fp)
            for sock in socks:
                try:
                    sock.send_multipart([encode(env), forged], zmq.NOBLOCK)
                    observed["sent"] += 1
                except zmq.Again:
                    pass
        for monitor in monitors:
            while monitor.poll(0):
                event = parse_monitor_message(monitor.recv_multipart())["event"]
                observed["handshakes_failed"] += int(event) in FAILED
                observed["handshakes_ok"] += int(event) == zmq.EVENT_HANDSHAKE_SUCCEEDED
        observed["status_reply"] |= bool(status.poll(0))
        time.sleep(0.01)
    (folder / "squatter.json").write_text(json.dumps(observed))
    for sock in [status, *socks, *monitors]:
        sock.close(0)
    ctx.term()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
