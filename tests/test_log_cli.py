"""The dsml command's shared options and error output: --log-level, DSML_REGISTRY, tracebacks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsml.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"

pytestmark = pytest.mark.multiprocess


def dsml_cmd(*args: str, env: dict[str, str] | None = None, timeout: float = 60):
    return subprocess.run(
        [sys.executable, "-m", "dsml", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def test_every_command_takes_log_level_and_names_dsml_registry_where_it_has_registry():
    parser = build_parser({})
    commands = {"registry", "worker", "run", "bench", "status", "keys"}
    seen = set()
    for name, command in parser._subparsers._group_actions[0].choices.items():
        seen.add(name)
        text = command.format_help()
        assert "--log-level" in text, name
        if "--registry" in text:
            assert "$DSML_REGISTRY" in text, name
    assert commands <= seen


def test_dsml_registry_is_the_default_registry_of_status_which_no_longer_requires_the_flag():
    parser = build_parser({"DSML_REGISTRY": "tcp://127.0.0.1:9"})
    assert parser.parse_args(["status"]).registry == "tcp://127.0.0.1:9"
    assert parser.parse_args(["worker"]).registry == "tcp://127.0.0.1:9"
    assert parser.parse_args(["status", "--registry", "tcp://h:1"]).registry == "tcp://h:1"
    # neither flag nor variable: not required in the usage (it reads DSML_REGISTRY); the
    # command itself refuses to run (tests/test_cli.py: exit 2, naming both)
    assert build_parser({}).parse_args(["status"]).registry is None


def test_status_without_the_flag_asks_the_registry_named_by_the_variable():
    result = dsml_cmd("status", "--wait", "0.5", env={"DSML_REGISTRY": "tcp://127.0.0.1:9"})
    assert result.returncode == 1
    assert "tcp://127.0.0.1:9" in result.stdout + result.stderr


def test_an_unknown_log_level_fails_with_the_valid_names():
    result = dsml_cmd("status", "--log-level", "loud")
    assert result.returncode == 2
    assert "debug, info, warning, error" in result.stderr
    result = dsml_cmd("status", env={"DSML_LOG_LEVEL": "loud", "DSML_REGISTRY": "tcp://h:1"})
    assert result.returncode == 2
    assert "unknown log level 'loud'" in result.stderr


def test_log_level_reaches_every_rank_and_each_line_names_its_rank(tmp_path):
    script = tmp_path / "log_line.py"
    script.write_text(
        "import logging, dsml\n"
        "logging.getLogger('dsml.example').info('hello from a rank')\n"
        "logging.getLogger('dsml.example').debug('not shown at info')\n"
    )
    result = dsml_cmd("run", "--log-level", "info", "-n", "2", str(script))
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        assert f"INFO    dsml.example [rank {rank}] hello from a rank" in result.stderr
    assert "not shown" not in result.stderr


def test_a_failing_rank_s_traceback_is_printed_once():
    result = dsml_cmd("run", "-n", "2", str(SCRIPTS / "fail_on_rank.py"), env={"FAIL_RANK": "1"})
    assert result.returncode == 1
    err = result.stderr
    assert err.count('fail_on_rank.py", line 15, in main') == 1, err
    assert "rank 1's error (traceback above) ----\n  RuntimeError: rank 1 cannot find" in err


def test_debug_level_shows_one_line_per_collective_on_every_rank():
    result = dsml_cmd(
        "run", "-n", "2", "examples/hello_all_reduce.py", env={"DSML_LOG_LEVEL": "debug"}
    )
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        lines = [
            line
            for line in result.stderr.splitlines()
            if line.startswith(f"[rank {rank}]") and "dsml.communicator" in line and " in " in line
        ]
        collectives = [line.split(f"[rank {rank} epoch 1] ", 1)[1].split(" (")[0] for line in lines]
        # examples/hello_all_reduce.py makes exactly these calls
        assert collectives == [
            "all_reduce #1",
            "broadcast #2",
            "all_gather #3",
            "barrier #4",
            "all_reduce #5",
        ], result.stderr
