"""The docs' figures match the code: each docs/img/*.json names only algorithms, ops and
fields that `dsml bench` has today, every algorithm `--algorithm all` runs, and the command
that made it, which the page showing the figure also gives."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dsml.cli.bench import _algorithms
from dsml.cli.bench_worker import row
from dsml.collectives import ALL_REDUCE_ALGORITHMS
from dsml.collectives.ops import ReduceOp

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parent.parent
FIGURES = sorted((ROOT / "docs" / "img").glob("*.json"))
#: the fields a `dsml bench --json` row has today (device, and gpu_reduce on a GPU, added)
FIELDS = set(row(4096, 2, "ring", "sum", np.ones(3), "ring")) | {"device", "gpu_reduce"}


def rows(figure: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for run in figure["runs"] for r in run]


def test_there_are_figures():
    assert FIGURES, "docs/img has no figure data"


@pytest.mark.parametrize("path", FIGURES, ids=[p.stem for p in FIGURES])
def test_a_figure_names_only_what_the_code_has_and_every_algorithm_it_runs(path: Path):
    figure = json.loads(path.read_text())
    assert path.with_suffix(".png").exists()
    every = rows(figure)
    assert every, path
    for r in every:
        assert set(r) <= FIELDS, f"{path.name}: fields no longer printed: {set(r) - FIELDS}"
        assert r["algorithm"] in ("auto", *ALL_REDUCE_ALGORITHMS), r
        assert r["chosen"] in ALL_REDUCE_ALGORITHMS, r
        assert r["op"] in {op.value for op in ReduceOp}, r
        assert r["device"] == "cpu" or r["device"].startswith("cuda"), r
        assert r.get("gpu_reduce", "host") in ("host", "device"), r
    if "--algorithm" not in figure["command"]:  # plot_bench.py runs --algorithm all
        assert {r["algorithm"] for r in every} == set(_algorithms("all")), path.name


@pytest.mark.parametrize("path", FIGURES, ids=[p.stem for p in FIGURES])
def test_a_figure_records_the_command_that_made_it_and_its_page_gives_it(path: Path):
    figure = json.loads(path.read_text())
    command = figure["command"]
    script = re.match(r"python (benchmarks/\w+\.py) ", command)
    assert script, command
    assert (ROOT / script[1]).exists(), command
    pages = [p for p in (ROOT / "docs").glob("*.md") if f"img/{path.stem}.png" in p.read_text()]
    assert pages, f"no page shows {path.stem}.png"
    for page in pages:
        assert command in page.read_text(), f"{page.name} does not give `{command}`"
