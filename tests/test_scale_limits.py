"""Descriptor limits at scale: a group too large for RLIMIT_NOFILE fails with a clear
ConfigError, a low soft limit is raised, and shared-memory mappings keep no descriptor."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from dsml.errors import ConfigError
from dsml.transport import context
from dsml.transport.limits import FDS_BASE, FDS_PER_PEER, check_group_fits
from dsml.transport.shm_segment import SHM_DIR, Segment, segment_name
from tests.test_launch_launchers import clean_env

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "launch_check.py"
RANKS = 12
#: a limit a group of RANKS fits in once shared memory keeps no descriptors (about 22 + 5
#: per peer: 77), but not with the check's margin (FDS_BASE + 5 per peer), nor with the
#: 7 per peer a mapping's descriptors cost before (99)
LOW = 80
_HARD = resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def _run_group(soft: int, hard: int) -> subprocess.CompletedProcess[str]:
    """`dsml run -n RANKS` of launch_check.py with RLIMIT_NOFILE set to (soft, hard).

    The limit is set by a small interpreter that then execs `dsml run`, not by a
    `preexec_fn`: forking this (multithreaded, once JAX is imported) process to run Python
    code before exec may deadlock."""
    command = [sys.executable, "-m", "dsml", "run", "-n", str(RANKS), str(SCRIPT), "DSML_RANK"]
    limited = (
        "import os, resource, sys; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard})); "
        "os.execv(sys.executable, sys.argv[1:])"
    )
    return subprocess.run(
        [sys.executable, "-c", limited, *command],
        env=clean_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )


@pytest.mark.timeout(180)
def test_a_group_over_the_descriptor_limit_fails_with_a_config_error_naming_it() -> None:
    assert FDS_BASE + FDS_PER_PEER * (RANKS - 1) > LOW  # else this test proves nothing
    result = _run_group(LOW, LOW)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "ConfigError" in output, output[-3000:]
    assert f"a group of {RANKS} ranks needs about" in output
    assert f"RLIMIT_NOFILE: soft {LOW}, hard {LOW}" in output
    assert "Too many open files" not in output, output[-3000:]
    assert "LAUNCH " not in output


@pytest.mark.skipif(_HARD < 4 * LOW, reason=f"the hard descriptor limit is only {_HARD}")
@pytest.mark.timeout(180)
def test_a_low_soft_descriptor_limit_is_raised_so_the_group_runs() -> None:
    result = _run_group(LOW, 4 * LOW)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    reports = [
        json.loads(line.split("LAUNCH ", 1)[1]) for line in output.splitlines() if "LAUNCH " in line
    ]
    assert sorted(r["rank"] for r in reports) == list(range(RANKS))
    assert all(r["sum_ok"] and r["world_size"] == RANKS for r in reports)


def test_the_socket_limit_is_checked_and_named() -> None:
    check_group_fits(10, max_sockets=1023)
    with pytest.raises(ConfigError, match=r"zmq\.MAX_SOCKETS"):
        check_group_fits(1000, max_sockets=1023)


def test_the_shared_context_has_room_for_as_many_sockets_as_descriptors() -> None:
    sock = context.new_socket(zmq.DEALER)  # the context exists once a socket was made
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert soft == min(hard, 1 << 20)  # raised when the context was made
        shared = context._shared_context()
        assert shared.get(zmq.MAX_SOCKETS) == min(shared.get(zmq.SOCKET_LIMIT), max(1023, soft))
    finally:
        sock.close()


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")
def test_mapped_segments_keep_no_file_descriptor() -> None:
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = open_fds()
    made = [Segment.create(segment_name(os.getpid(), "fdtest", i, "c"), 1 << 16) for i in range(4)]
    mapped = [Segment.open(seg.name) for seg in made]
    try:
        assert open_fds() == before
        assert all(m is not None for m in mapped)
        made[0].map[:8] = b"12345678"
        assert mapped[0] is not None
        assert bytes(mapped[0].map[:8]) == b"12345678"
    finally:
        for seg in [*made, *mapped]:
            if seg is not None:
                assert seg.close()
    assert open_fds() == before
