"""How fast a namespaced link is: one TCP stream between two hosts (testing helpers).

`measure_rate(src, dst)` starts a receiver on `dst` and a sender on `src` (two small
Python scripts, run by `sys.executable`) and returns the bits per second the receiver
saw; `python -m dsml.testing.netns` (netns.py, which re-exports it) measures each kind
of link with it. Nothing in dsml imports this module.
"""

from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING

from .netns_commands import NetnsError

if TYPE_CHECKING:
    from .netns import Host

__all__ = ["measure_rate"]

_SINK = """
import socket, sys, time
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
conn, _ = server.accept()
buf, total, start = bytearray(1 << 20), 0, None
while n := conn.recv_into(buf):
    start = start or time.perf_counter()
    total += n
print(total, time.perf_counter() - (start or time.perf_counter()), flush=True)
"""
_SOURCE = """
import socket, sys
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])))
chunk = bytes(1 << 20)
for _ in range(int(sys.argv[3]) >> 20):
    conn.sendall(chunk)
conn.close()
"""


def measure_rate(src: Host, dst: Host, n_bytes: int = 256 << 20, port: int = 5201) -> float:
    """Bits per second one TCP stream carries from `src` to `dst` (an iperf-like probe).

    Timed at the receiver from its first byte to the end of the stream, so connection
    set-up is left out; `n_bytes` is rounded down to whole MiB. Runs `sys.executable`.
    """
    python = sys.executable
    sink = dst.popen([python, "-c", _SINK, str(port)], stdout=subprocess.PIPE, text=True)
    assert sink.stdout is not None
    if sink.stdout.readline().strip() != "ready":
        raise NetnsError(f"the receiver on {dst.name} did not start")
    src.run([python, "-c", _SOURCE, dst.address, str(port), str(n_bytes)], timeout=300.0)
    total, seconds = sink.stdout.readline().split()
    sink.wait(timeout=10.0)
    return int(total) * 8 / float(seconds)
