"""The commands under the namespaced hosts of netns.py (testing helpers).

Whether namespaced hosts can be built here (`unavailable_reason`), running one command
and turning its failure into `NetnsError` (`_sh`), the `tc` arguments of a token-bucket
link (`tbf_args`), the namespaces this harness made that still exist (`leftover_namespaces`)
and removing those of runs that died, and killing what ran on the hosts (a command's
process group, then anything left inside a namespace). netns.py re-exports the public
names; nothing in dsml imports this module.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

__all__ = ["NetnsError", "leftover_namespaces", "tbf_args", "unavailable_reason"]

_PREFIX = "dsmlnet"
_NETNS_DIR = Path("/run/netns")
_TOOLS = ("ip", "tc", "nsenter", "unshare", "mount", "hostname")


class NetnsError(RuntimeError):
    """A namespace command failed (its stderr is in the message)."""


def unavailable_reason() -> str | None:
    """Why namespaced hosts cannot be built here, or None when they can."""
    if not hasattr(os, "geteuid") or os.uname().sysname != "Linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"not found on PATH: {', '.join(missing)} (install iproute2, util-linux, mount)"
    return None


def _sh(*argv: str) -> str:
    """Run one command; raise NetnsError with its stderr when it fails."""
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def leftover_namespaces(owner_pid: int | None = None) -> list[str]:
    """Namespaces made by this module (by `owner_pid` when given) that still exist."""
    out = _sh("ip", "netns", "list")
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    pattern = re.compile(rf"{_PREFIX}(\d+)x")
    found = []
    for name in names:
        match = pattern.match(name)
        if match and (owner_pid is None or int(match.group(1)) == owner_pid):
            found.append(name)
    return found


def _remove_orphans() -> None:
    """Delete namespaces left by runs whose process died before cleaning up."""
    for name in leftover_namespaces():
        owner = int(name[len(_PREFIX) :].split("x")[0])
        if not _alive(owner):
            with contextlib.suppress(NetnsError):
                _sh("ip", "netns", "delete", name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tbf_args(rate: str) -> list[str]:
    """`tc` arguments for a token bucket at `rate` ("1gbit", "10gbit", "500mbit").

    The bucket holds 4 ms of traffic (at least 64 KiB, so a whole GSO packet fits), and
    packets wait up to 20 ms for tokens before they are dropped.
    """
    bits = _rate_bits(rate)
    burst_bytes = max(64 * 1024, bits // 8 // 250)
    return ["tbf", "rate", rate, "burst", str(burst_bytes), "latency", "20ms"]


def _rate_bits(rate: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if not match:
        raise ValueError(f"rate must look like '1gbit', '10gbit' or '500mbit', got {rate!r}")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[match.group(2)]
    return int(float(match.group(1)) * scale)


def _kill_inside(netns: str) -> None:
    """SIGKILL every process still in `netns` (by PID), such as daemons' detached helpers.

    Only processes started through this harness can be inside its namespaces.
    """
    for _ in range(50):
        try:
            pids = [int(p) for p in _sh("ip", "netns", "pids", netns).split()]
        except NetnsError:
            return
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL the process group a harness command leads, then reap its leader."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5.0)
