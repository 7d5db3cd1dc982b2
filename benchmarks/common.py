"""What the benchmark scripts share: running `dsml` as a subprocess and reading its rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def dsml(*args: str, env: dict[str, str] | None = None, cwd: str | None = None) -> str:
    """Run `python -m dsml ARGS...` and return its standard output (raise if it fails).
    `python -m` imports from the working directory first: to run another checkout's dsml,
    pass it as `cwd` (and PYTHONPATH), or a run from this checkout's folder runs this one."""
    cmd = [sys.executable, "-m", "dsml", *args]
    environment = {**os.environ, **(env or {})}
    return subprocess.run(
        cmd, check=True, capture_output=True, text=True, env=environment, cwd=cwd
    ).stdout


def dsml_version() -> str:
    """The version and commit of the dsml a benchmark ran (the commit: where it is a git
    checkout), to write beside its figures."""
    version = dsml("--version").split()[-1]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return f"{version} ({commit})" if commit else version


def bench_rows(
    world_size: int,
    sizes: str,
    algorithms: str,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> list[dict[str, Any]]:
    """The rows `dsml bench --json` prints (`env`: extra environment variables; `cwd`:
    another checkout to run, see `dsml`)."""
    out = dsml(
        "bench",
        "-n",
        str(world_size),
        "--sizes",
        sizes,
        "--algorithm",
        algorithms,
        "--json",
        env=env,
        cwd=cwd,
    )
    return json.loads(out[out.index("[") :])  # type: ignore[no-any-return]


def tagged_lines(out: str, tag: str) -> list[str]:
    """The payloads of lines of the form `[rank 0] TAG payload` (or `TAG payload`)."""
    return [line.split(tag + " ", 1)[1] for line in out.splitlines() if tag + " " in line]
