"""Processes the tests start and stop: a `dsml registry` of their own (no test here)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DSML = [sys.executable, "-m", "dsml"]


@contextlib.contextmanager
def dsml_registry(*options: str, stop_within: float = 20.0) -> Iterator[str]:
    """A `dsml registry` process on a free loopback port (more `options` as given);
    yields its address; stopped by SIGTERM, and must then exit 0."""
    proc = subprocess.Popen(
        [*DSML, "registry", "--address", "tcp://127.0.0.1:0", *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        address = line.strip().rsplit(" ", 1)[-1]
        assert address.startswith("tcp://127.0.0.1:"), line
        yield address
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=stop_within)
    assert proc.returncode == 0
