"""Transport layer: the only code that imports zmq.

One endpoint (bound ROUTER) per worker with a single reader task, DEALER channels to peers,
per-key mailboxes, receipts for buffers sent without copying; every connection proves the
job secret (or, with CURVE, an allowlisted key) before any of its messages is read.
"""

from .beacon import Beacon
from .context import check_address, check_peers_fit, live_sockets
from .curve import Curve, generate_keys, is_loopback
from .mailbox import Mailbox
from .malloc import tune_malloc
from .secret import JobSecret, job_secret
from .sockets import Channel, Endpoint, Handler
from .tracker import DONE, Sent, wait_sent
from .zap import prove_secret

__all__ = [
    "DONE",
    "Beacon",
    "Channel",
    "Curve",
    "Endpoint",
    "Handler",
    "JobSecret",
    "Mailbox",
    "Sent",
    "check_address",
    "check_peers_fit",
    "generate_keys",
    "is_loopback",
    "job_secret",
    "live_sockets",
    "prove_secret",
    "tune_malloc",
    "wait_sent",
]
