"""Transport layer: the only code that imports zmq.

One endpoint (bound ROUTER) per worker with a single reader task, DEALER channels to peers,
per-key mailboxes, receipts for buffers sent without copying, and CURVE (encryption and a
client allowlist) for any of these sockets.
"""

from .beacon import Beacon
from .context import check_address, check_peers_fit, live_sockets
from .curve import Curve, generate_keys, is_loopback
from .mailbox import Mailbox
from .malloc import tune_malloc
from .sockets import Channel, Endpoint, Handler
from .tracker import DONE, Sent, wait_sent

__all__ = [
    "DONE",
    "Beacon",
    "Channel",
    "Curve",
    "Endpoint",
    "Handler",
    "Mailbox",
    "Sent",
    "check_address",
    "check_peers_fit",
    "generate_keys",
    "is_loopback",
    "live_sockets",
    "tune_malloc",
    "wait_sent",
]
