"""Device names, the errors without CUDA, `dsml run --device`, and cupy staying unimported.

All of this runs without a GPU: "cupy missing" is simulated by blocking the import, and
"cupy present" by the fake cupy of tests/fakes (see tests/gpu_fakes.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dsml
from dsml.collectives import backend_of
from dsml.collectives.devices import DeviceSpec, is_cupy_array, parse_device, resolve_device
from dsml.launch.rank_setup import rank_environment
from tests.gpu_fakes import FAKES

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, DeviceSpec("cpu")),
        ("cpu", DeviceSpec("cpu")),
        ("cuda", DeviceSpec("cuda")),
        ("cuda:0", DeviceSpec("cuda", 0)),
        (" CUDA:3 ", DeviceSpec("cuda", 3)),
    ],
)
def test_device_names_parse_to_a_kind_and_an_optional_index(text, expected):
    assert parse_device(text) == expected
    assert str(parse_device(str(expected))) == str(expected)


@pytest.mark.parametrize("text", ["gpu", "cuda:", "cuda:-1", "cuda:x", "cpu:0", "", 0, "cuda:1:2"])
def test_a_malformed_device_name_is_a_config_error_naming_the_forms(text):
    with pytest.raises(dsml.ConfigError, match="use 'cpu', 'cuda' or 'cuda:N'"):
        parse_device(text)


def test_cupy_arrays_are_recognised_by_their_type_module_alone():
    class ndarray:
        pass

    ndarray.__module__ = "cupy._core.core"
    assert is_cupy_array(ndarray())
    assert not is_cupy_array(np.zeros(3))
    assert not is_cupy_array([1, 2])


def test_an_unknown_array_type_is_refused_with_what_to_do():
    with pytest.raises(dsml.ConfigError, match=r"numpy array \(or a cupy array\), got list"):
        backend_of([1, 2, 3])


def test_asking_for_cuda_without_cupy_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    with pytest.raises(dsml.ConfigError, match=r'pip install "dsml\[gpu\]"'):
        resolve_device(parse_device("cuda"), 0)
    with pytest.raises(dsml.ConfigError, match=r'pip install "dsml\[gpu\]"'):
        dsml.init("tcp://127.0.0.1:1", world_size=1, device="cuda:0")


def test_asking_for_cuda_without_a_gpu_says_so(fake_cupy, monkeypatch):
    for count in ("0", "-1"):  # no device; no driver (getDeviceCount raises)
        monkeypatch.setenv("FAKE_CUPY_DEVICES", count)
        with pytest.raises(dsml.ConfigError, match="no CUDA GPU is visible"):
            dsml.init("tcp://127.0.0.1:1", world_size=1, device="cuda")


def test_cuda_picks_the_local_rank_modulo_the_gpu_count(fake_cupy, monkeypatch):
    monkeypatch.setenv("FAKE_CUPY_DEVICES", "2")
    assert resolve_device(parse_device("cuda"), 3) == "cuda:1"
    assert resolve_device(parse_device("cuda"), None) == "cuda:0"
    assert resolve_device(parse_device("cuda:1"), 0) == "cuda:1"
    assert resolve_device(parse_device("cpu"), 5) == "cpu"
    with pytest.raises(dsml.ConfigError, match=r"sees 2 GPU\(s\), cuda:0..cuda:1"):
        resolve_device(parse_device("cuda:2"), 0)


async def test_init_places_the_communicator_and_makes_the_gpu_current(fake_cupy, monkeypatch):
    monkeypatch.setenv("FAKE_CUPY_DEVICES", "2")
    monkeypatch.setenv("LOCAL_RANK", "3")
    async with dsml.open_registry() as registry:
        async with dsml.init(registry.address, world_size=1, device="cuda") as comm:
            assert comm.device == "cuda:1"
            assert ("use", 1) in fake_cupy.LOG
        monkeypatch.setenv("DSML_DEVICE", "cpu")
        async with dsml.init(registry.address, world_size=1) as comm:
            assert comm.device == "cpu"


def test_gpu_reduce_takes_host_or_device_only():
    assert dsml.CommConfig().gpu_reduce == "host"
    dsml.CommConfig(gpu_reduce="device")
    with pytest.raises(dsml.ConfigError, match="gpu_reduce must be 'host' or 'device'"):
        dsml.CommConfig(gpu_reduce="gpu")


def test_rank_environment_gives_every_rank_the_device_and_its_local_rank():
    for rank in range(3):
        env = rank_environment({}, rank, 3, "tcp://127.0.0.1:1", "cuda")
        assert env["DSML_DEVICE"] == "cuda"
        assert env["LOCAL_RANK"] == env["DSML_LOCAL_RANK"] == str(rank)
    assert "DSML_DEVICE" not in rank_environment({}, 0, 1, "tcp://127.0.0.1:1")


def _dsml(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dsml", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        timeout=60,
    )


def test_import_dsml_never_imports_cupy():
    code = (
        "import sys, numpy as np, dsml, dsml.cli, dsml.testing, dsml.cli.bench_worker\n"
        "from dsml.collectives import backend_of\n"
        "backend_of(np.zeros(2)); dsml.CommConfig()\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] == 'cupy' or m.endswith('.cuda')]\n"
        "assert not loaded, loaded\n"
    )
    # The fake cupy on the path refuses to be imported at all, so any import would show.
    blocker = str(ROOT / "tests" / "scripts" / "no_cupy")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([blocker, str(ROOT)])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr


@pytest.mark.multiprocess
def test_run_with_cuda_and_no_cupy_fails_at_once_with_the_install_line():
    # cupy is hidden, so this also holds on a GPU machine that has it (it failed there)
    env = {"PYTHONPATH": os.pathsep.join([str(SCRIPTS / "no_cupy"), str(ROOT)])}
    result = _dsml("run", "--device", "cuda", "-n", "2", str(SCRIPTS / "show_env.py"), env=env)
    assert result.returncode == 2
    assert "dsml run:" in result.stderr
    assert 'pip install "dsml[gpu]"' in result.stderr
    bench = _dsml("bench", "--device", "cuda", "-n", "2", "--sizes", "4K", env=env)
    assert bench.returncode == 2
    assert "dsml bench:" in bench.stderr


@pytest.mark.multiprocess
def test_run_with_cuda_gives_rank_i_gpu_i_modulo_the_gpu_count():
    env = {"PYTHONPATH": os.pathsep.join([str(FAKES), str(ROOT)]), "FAKE_CUPY_DEVICES": "2"}
    result = _dsml("run", "--device", "cuda", "-n", "3", str(SCRIPTS / "show_env.py"), env=env)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line.split("] ", 1)[1]) for line in result.stdout.splitlines()]
    by_rank = {int(r["RANK"]): r for r in rows}
    for rank, row in by_rank.items():
        assert row["DSML_DEVICE"] == "cuda"
        assert row["LOCAL_RANK"] == row["DSML_LOCAL_RANK"] == str(rank)
        assert row["comm_device"] == f"cuda:{rank % 2}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("place", ["host", "device"])
def test_bench_on_cuda_reduces_where_gpu_reduce_says_and_labels_it(place):
    env = {"PYTHONPATH": os.pathsep.join([str(FAKES), str(ROOT)])}
    args = ("bench", "--device", "cuda", "-n", "2", "--sizes", "4K", "--iters", "3")
    result = _dsml(*args, "--gpu-reduce", place, "--json", env=env)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(r["device"], r["gpu_reduce"]) for r in rows] == [("cuda:0", place)]
    table = _dsml(*args, "--gpu-reduce", place, env=env)
    assert f"device=cuda gpu_reduce={place}" in table.stdout.splitlines()[0]
