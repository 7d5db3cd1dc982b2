"""Waiting for the processes a test started (cli, launchers, IPv6 tests)."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence


def joined_output(procs: Sequence[subprocess.Popen[str]], timeout: float = 50) -> str:
    """Every process's stdout, in order, once each has exited 0; those still running when
    one fails (or the wait runs out) are killed, so none outlives the test."""
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, out + err
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return "".join(outputs)
