"""Transport layer: the only code that imports zmq.

One endpoint (bound ROUTER) per worker with a single reader task, DEALER channels to peers,
per-key mailboxes, and receipts for buffers sent without copying.
"""

from .beacon import Beacon
from .context import check_address, live_sockets
from .mailbox import Mailbox
from .malloc import tune_malloc
from .sockets import Channel, Endpoint, Handler
from .tracker import DONE, Sent, wait_sent

__all__ = [
    "DONE",
    "Beacon",
    "Channel",
    "Endpoint",
    "Handler",
    "Mailbox",
    "Sent",
    "check_address",
    "live_sockets",
    "tune_malloc",
    "wait_sent",
]
