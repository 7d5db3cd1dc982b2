"""`dsml bench`: percentiles, iterations and the algorithm auto chose; clean stdout/stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsml.cli.bench import format_row
from dsml.collectives import ALL_REDUCE_ALGORITHMS

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.multiprocess


def bench(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dsml", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=dict(os.environ),
    )


def test_bench_json_carries_percentiles_iterations_and_the_chosen_algorithm_per_size():
    result = bench(
        "-n", "2", "--sizes", "4K,128K", "--algorithm", "auto,ring", "--iters", "5", "--json"
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)  # stdout is the JSON list and nothing else
    assert [(r["bytes"], r["algorithm"]) for r in rows] == [
        (4096, "auto"),
        (4096, "ring"),
        (131072, "auto"),
        (131072, "ring"),
    ]
    for row in rows:
        assert row["iterations"] == 5
        assert 0 < row["p10_s"] <= row["p50_s"] <= row["p90_s"]
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / row["p50_s"] / 1e9)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * (2 - 1) / 2)
        assert row["chosen"] in ALL_REDUCE_ALGORITHMS
        if row["algorithm"] != "auto":
            assert row["chosen"] == row["algorithm"]


def test_bench_table_shows_iterations_percentiles_and_what_auto_chose():
    result = bench("-n", "2", "--sizes", "4K", "--iters", "4")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines[0].startswith("# dsml bench: world_size=2")
    assert lines[1].split()[1:] == [
        "bytes",
        "algorithm",
        "iters",
        "p10(us)",
        "p50(us)",
        "p90(us)",
        "algbw(GB/s)",
        "busbw(GB/s)",
    ]
    fields = lines[2].split()
    assert fields[0] == "4096"
    assert fields[1].startswith("auto(")
    assert fields[1][5:-1] in ALL_REDUCE_ALGORITHMS
    assert fields[2] == "4"
    p10, p50, p90 = map(float, fields[3:6])
    assert p10 <= p50 <= p90


def test_an_unknown_algorithm_fails_on_stderr_naming_every_valid_one():
    result = bench("-n", "2", "--algorithm", "ring,fastest", "--json")
    assert result.returncode == 2
    assert result.stdout == ""
    assert "'fastest'" in result.stderr
    for name in ("auto", *ALL_REDUCE_ALGORITHMS):
        assert repr(name) in result.stderr


def test_bench_help_lists_every_algorithm():
    text = bench("--help").stdout
    for name in ("auto", *ALL_REDUCE_ALGORITHMS):
        assert name in text
    assert "p10_s" in text


def test_a_named_algorithm_is_not_labelled_with_what_the_timing_reduction_ran():
    """50 timed calls of 400 bytes: the max of their times is 400 bytes too (auto's
    choice, shm). The row must say ring, not ring(shm)."""
    result = bench("-n", "2", "--sizes", "400", "--algorithm", "ring", "--iters", "50")
    assert result.returncode == 0, result.stderr
    row = [line for line in result.stdout.splitlines() if line.strip()][2].split()
    assert row[:3] == ["400", "ring", "50"]


def test_a_row_names_what_ran_when_it_is_not_what_was_asked():
    """`--algorithm shm` with shared memory off runs the ring over TCP: the row says so."""

    def label(algorithm: str, chosen: str) -> str:
        row = {"bytes": 4096, "algorithm": algorithm, "chosen": chosen, "iterations": 1}
        row |= {"p10_s": 1e-5, "p50_s": 1e-5, "p90_s": 1e-5, "algbw_GBps": 0.4}
        return format_row(row | {"busbw_GBps": 0.4}).split()[1]

    assert label("shm", "ring") == "shm(ring)"
    assert label("auto", "shm") == "auto(shm)"
    assert label("ring", "ring") == "ring"
