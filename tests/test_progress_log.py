"""The progress log: a collective waiting long on its peers warns whom it waits for."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import dsml
from dsml import CommConfig, ConfigError
from dsml.communicator.diagnose import still_waiting_message
from dsml.communicator.init import _resolve
from dsml.communicator.waiting import WaitingFor
from dsml.testing import open_local_cluster

ROOT = Path(__file__).resolve().parent.parent
_ENV = "DSML_PROGRESS_AFTER"
LINE = re.compile(r"still waiting after (\d+\.\d) s in (\w+) \(collective #(\d+)\) for (.*)$")


class ProgressLines(logging.Handler):
    """Collects the progress log's lines; tests wait on them instead of sleeping."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._changed = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("still waiting after"):
            self.records.append(record)
            self._changed.set()

    def of(self, rank: int) -> list[logging.LogRecord]:
        return [r for r in self.records if getattr(r, "rank", None) == rank]

    async def wait_for(self, predicate: Callable[[], bool], within: float = 30.0) -> None:
        async with asyncio.timeout(within):
            while not predicate():
                self._changed.clear()
                await self._changed.wait()


@pytest.fixture
def progress_lines() -> Iterator[ProgressLines]:
    logger = logging.getLogger("dsml.communicator")
    handler, level = ProgressLines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _parsed(record: logging.LogRecord) -> tuple[float, str, int, str]:
    match = LINE.match(record.getMessage())
    assert match, record.getMessage()
    return float(match[1]), match[2], int(match[3]), match[4]


async def test_a_call_waiting_on_a_late_rank_warns_naming_only_that_rank(progress_lines):
    async with open_local_cluster(3, config=CommConfig(progress_after=0.5)) as cluster:
        await cluster.run(lambda c: c.barrier())  # collective #1: every rank was seen there

        async def rank_2_late(comm):
            if comm.rank == 2:  # until both others have said whom they wait for
                await progress_lines.wait_for(lambda: progress_lines.of(0) and progress_lines.of(1))
            await comm.barrier()

        await cluster.run(rank_2_late)
    assert progress_lines.of(2) == []
    for record in progress_lines.records:
        assert record.levelno == logging.WARNING
        elapsed, kind, cid, whom = _parsed(record)
        assert (kind, cid) == ("barrier", 2)
        assert whom == "rank 2 (last seen at collective #1 barrier)"
        assert elapsed >= 0.45


async def test_a_ring_names_the_late_rank_not_the_neighbour_it_receives_from(progress_lines):
    """Over TCP, rank 1 receives from rank 0, which waits for rank 2: both name rank 2."""
    config = CommConfig(progress_after=0.5, shm=False)
    async with open_local_cluster(3, config=config) as cluster:

        async def rank_2_late(comm):
            if comm.rank == 2:
                await progress_lines.wait_for(lambda: progress_lines.of(0) and progress_lines.of(1))
            return await comm.all_reduce(np.ones(4096), algorithm="ring")

        results = await cluster.run(rank_2_late)
    assert all((r == 3).all() for r in results)
    assert {r.rank for r in progress_lines.records} == {0, 1}
    for record in progress_lines.records:
        assert _parsed(record)[1:] == (
            "all_reduce",
            1,
            "rank 2 (last seen at collective #0)",
        ), record.getMessage()


async def test_the_progress_lines_come_at_doubling_intervals(progress_lines):
    first = 0.4
    async with open_local_cluster(2, config=CommConfig(progress_after=first)) as cluster:

        async def rank_1_late(comm):
            if comm.rank == 1:
                await progress_lines.wait_for(lambda: len(progress_lines.of(0)) >= 3)
            await comm.all_reduce(np.ones(8))

        await cluster.run(rank_1_late)
    ages = [_parsed(r)[0] for r in progress_lines.of(0)]
    assert all(a < b for a, b in itertools.pairwise(ages)), ages
    for i, age in enumerate(ages[:3]):  # a look is never early: first, 2x first, 4x first
        assert age >= first * 2**i - 0.05, ages
    assert _parsed(progress_lines.of(0)[0])[3] == "rank 1 (last seen at collective #0)"


async def test_fast_calls_log_nothing(progress_lines):
    async with open_local_cluster(2, config=CommConfig(progress_after=0.3)) as cluster:
        for _ in range(5):
            await cluster.run(lambda c: c.barrier())
            await cluster.run(lambda c: c.all_reduce(np.arange(100.0)))
        await asyncio.sleep(0.6)  # past the first look of every call: their timers are gone
    assert progress_lines.records == []


@pytest.mark.parametrize("off", [0, None])
async def test_progress_after_zero_or_none_turns_the_log_off(progress_lines, off):
    async with open_local_cluster(2, config=CommConfig(progress_after=off)) as cluster:

        async def rank_1_late(comm):
            if comm.rank == 1:
                await asyncio.sleep(0.8)  # the lateness is the point: nothing to wait on
            await comm.barrier()

        await cluster.run(rank_1_late)
    assert progress_lines.records == []


def test_the_line_names_a_few_missing_ranks_and_counts_the_rest():
    waiting = WaitingFor(5, asked=range(1, 10))
    for rank in (1, 2, 4, 5, 7):
        waiting.answer(rank, 4, "all_reduce")
    waiting.answer(3, 5, "all_reduce")  # arrived: not named
    waiting.answer(9, 6)  # ahead (its next call): arrived
    message = still_waiting_message("all_reduce", 5.04, waiting)
    assert message == (
        "still waiting after 5.0 s in all_reduce (collective #5) for "
        "rank 1 (last seen at collective #4 all_reduce), "
        "rank 2 (last seen at collective #4 all_reduce), "
        "rank 4 (last seen at collective #4 all_reduce), "
        "rank 5 (last seen at collective #4 all_reduce) and 3 more"
    )
    assert waiting.missing() == [1, 2, 4, 5, 6, 7, 8]
    assert waiting.silent() == [6, 8]


def test_the_line_says_when_no_rank_is_missing():
    waiting = WaitingFor(2, asked=[1])
    waiting.answer(1, 2)
    assert still_waiting_message("barrier", 6.0, waiting).endswith(
        ": every rank has arrived; its data is still in flight"
    )


def test_progress_after_must_be_a_non_negative_number_of_seconds():
    with pytest.raises(ConfigError, match="progress_after"):
        CommConfig(progress_after=-1.0)
    with pytest.raises(ConfigError, match="progress_after"):
        CommConfig(progress_after=float("inf"))


def test_dsml_progress_after_sets_the_field():
    env = {"DSML_PROGRESS_AFTER": "0"}
    args = _resolve("tcp://127.0.0.1:9", 2, 0, None, None, None, None, env)
    assert args.config.progress_after == 0
    args = _resolve("tcp://127.0.0.1:9", 2, 0, None, None, None, None, {})
    assert args.config.progress_after == CommConfig().progress_after


_LATE_RANK_SCRIPT = """
import asyncio, os, sys, time
import dsml

async def main():
    async with dsml.init() as comm:
        if comm.rank == 1:  # stays in the group without calling barrier until the test says
            deadline = time.monotonic() + 60
            while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        else:
            print("rank 0 calls barrier", flush=True)
        await comm.barrier()

asyncio.run(main())
"""


@pytest.mark.multiprocess
def test_dsml_run_shows_a_progress_line_for_a_rank_that_does_not_call_barrier(tmp_path):
    """The default setting: rank 0's line names rank 1 within 10 s of entering barrier."""
    script, go = tmp_path / "late_rank.py", tmp_path / "go"
    script.write_text(_LATE_RANK_SCRIPT)
    command = [sys.executable, "-m", "dsml", "run", "-n", "2", str(script), str(go)]
    env = {k: v for k, v in os.environ.items() if k not in ("DSML_LOG_LEVEL", _ENV)}
    with subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        try:
            lines = _lines_until(proc, lambda line: "still waiting after" in line, within=90)
        finally:
            go.touch()  # rank 1 calls barrier now: the run ends cleanly, its ranks with it
            rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, "".join(lines) + rest
    assert any("rank 0 calls barrier" in line for line in lines), lines
    warning = lines[-1]
    assert "[rank 0]" in warning, warning
    match = re.search(
        r"still waiting after (\d+\.\d) s in barrier \(collective #1\) for (.*)$", warning
    )
    assert match, warning
    assert match[2] == "rank 1 (last seen at collective #0)", warning
    assert 4.5 <= float(match[1]) < 10.0, warning


def _lines_until(
    proc: subprocess.Popen[str], found: Callable[[str], bool], within: float
) -> list[str]:
    """Lines of proc's output up to the first that `found` accepts (read on a thread)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, ""):
            lines.put(line)
            if found(line):
                break
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    seen: list[str] = []
    deadline = time.monotonic() + within
    while (line := lines.get(timeout=max(0.1, deadline - time.monotonic()))) is not None:
        seen.append(line)
    reader.join(timeout=5)
    assert seen, "no output"
    assert found(seen[-1]), "".join(seen)
    return seen


async def test_a_call_that_times_out_keeps_whom_it_waited_for_in_its_record(progress_lines):
    config = CommConfig(progress_after=0.2, timeout=1.5, probe_timeout=0.3)
    async with open_local_cluster(2, config=config) as cluster:
        with pytest.raises(dsml.CollectiveTimeoutError, match="rank 1 has not arrived"):
            await cluster[0].barrier()  # rank 1 never calls it
        record = cluster[0]._session.runner.stats.recent[-1]
    assert progress_lines.of(0), "no progress line before the timeout"
    assert record.outcome == "CollectiveTimeoutError"
    assert record.waiting_for is not None
    assert record.waiting_for.missing() == [1]
    assert record.waiting_for.started == {1: 0}
