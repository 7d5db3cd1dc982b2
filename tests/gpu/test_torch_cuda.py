"""The torch.distributed backend "dsml" on CUDA tensors, in real processes (needs torch with
CUDA and cupy; skipped otherwise): every collective, and DDP on the GPU against gloo."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install dsml[torch])")
pytest.importorskip("cupy", reason='cupy is not installed (pip install "dsml[gpu]")')

from tests.test_torch_backend import dsml_run  # noqa: E402 (after the skips)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multiprocess,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA GPU"),
]


def test_every_collective_works_on_cuda_tensors():
    result = dsml_run(2, "torch_collectives.py", "cuda")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split().count("ok") == 2, result.stdout


def test_ddp_on_the_gpu_over_dsml_ends_with_the_parameters_gloo_ends_with():
    result = dsml_run(2, "torch_ddp_compare.py", "20", "cuda")
    assert result.returncode == 0, result.stderr[-3000:]
    row = json.loads(result.stdout.strip().split("] ", 1)[1])
    assert row["ranks_agree"]
    assert row["max_diff"] < 1e-5
