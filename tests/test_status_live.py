"""Live status: progress summaries on heartbeats, the ranks waited for, `dsml status
--watch` and the page of `--serve` (loaded in a real headless Chromium)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio

from dsml import CommConfig, ProtocolError, open_registry
from dsml.config import RegistryConfig
from dsml.membership.live import mark_waited_for, read_summary
from dsml.status_page import StatusPoller, page, serve
from dsml.status_view import STRAGGLER_RATIO, render, rows, with_marks
from dsml.testing import open_local_cluster
from dsml.transport import prove_secret
from dsml.wire import Envelope, Kind
from dsml.wire.envelope import encode
from tests.procs import dsml_registry

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "status_hang.py"
DSML = [sys.executable, "-m", "dsml"]
STUCK = 2

# -- the pure parts ------------------------------------------------------------------------


def summary(call: list[Any] | None = None, waiting: list[int] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "call": call,
        "waiting_for": waiting,
        "calls_per_s": 2.5,
        "p50_us": [900, 700, 10, 0, 5, 185],
        "sampled": 3,
    }
    if waiting is not None:
        body["waiting_n"] = len(waiting)
    return body


def member(rank: int, started: int, progress: dict[str, Any] | None, age: float = 0.1):
    return {
        "rank": rank,
        "epoch": 1,
        "heartbeats": 5,
        "heartbeat_age": age,
        "started": [1, started, "all_reduce(...)"],
        "progress": read_summary(progress),
    }


@pytest.mark.parametrize(
    "bad",
    [
        "not a map",
        {**summary(), "call": [1, "all_reduce"]},
        {**summary(), "call": [1, "x" * 33, 0.5]},
        {**summary(), "call": [-1, "barrier", 0.5]},
        {**summary(waiting=list(range(33)))},
        {**summary(waiting=[1]), "waiting_n": "one"},
        {**summary(), "p50_us": [1, 2, 3]},
        {**summary(), "p50_us": [0.5] * 6},
        {**summary(), "calls_per_s": float("nan")},
        {**summary(), "sampled": None},
        {**summary(), **{f"extra{i}": i for i in range(8)}},
    ],
)
def test_a_malformed_progress_summary_is_refused(bad):
    with pytest.raises(ProtocolError, match=r"Heartbeat\.summary"):
        read_summary(bad)


def test_a_summary_reads_back_as_sent_and_none_stays_none():
    sent = summary([4, "all_reduce", 1.5], [2])
    assert read_summary(sent) == sent
    assert read_summary(None) is None


def test_ranks_named_by_a_probe_are_waited_for_by_the_ranks_that_probed():
    members = [
        member(0, 4, summary([4, "all_reduce", 6.0], [2])),
        member(1, 4, summary([4, "all_reduce", 6.0], [2, 3])),
        member(2, 3, summary()),
        member(3, 4, summary([4, "all_reduce", 6.0], [])),
    ]
    assert mark_waited_for(members, slow_s=1.0) == [2, 3]
    assert [m["waited_by"] for m in members] == [[], [], [0, 1], [1]]


def test_before_a_probe_a_slow_call_waits_for_the_ranks_behind_it_only():
    members = [
        member(0, 4, summary([4, "all_reduce", 0.5]), age=0.6),  # 1.1 s by now: slow
        member(1, 4, summary([4, "all_reduce", 0.2])),  # not slow yet: no verdict
        member(2, 3, summary()),
        member(3, 5, summary([5, "barrier", 3.0])),  # nobody else reached #5 either
    ]
    assert mark_waited_for(members, slow_s=1.0) == [0, 1, 2]
    assert [m["waited_by"] for m in members] == [[3], [3], [0, 3], []]


def test_a_waiter_names_at_most_32_ranks_behind_it_the_furthest_behind_first():
    waiter = member(0, 50, summary([50, "barrier", 3.0]))
    members = [waiter] + [member(r, 50 - r, summary()) for r in range(1, 41)]
    assert mark_waited_for(members, slow_s=1.0) == list(range(9, 41))


def test_nobody_is_waited_for_while_every_call_is_quick():
    members = [member(r, 4, summary([4, "all_reduce", 0.01])) for r in range(3)]
    assert mark_waited_for(members, slow_s=1.0) == []
    assert "STUCK" not in render("tcp://x:1", {"formed": True, "members": members})


async def test_a_heartbeat_with_a_malformed_summary_is_dropped_and_counted():
    async with open_registry("tcp://127.0.0.1:0") as registry:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        prove_secret(sock, b"mallory.hb")  # the job's secret: judged on its bytes alone
        try:
            sock.connect(registry.address)
            for bad in ({"call": "everything"}, {**summary(), "p50_us": [1] * 7}):
                body = {"epoch": 1, "summary": bad}
                await sock.send_multipart([encode(Envelope(Kind.HEARTBEAT, body=body))])
            await _until(lambda: registry.dropped_messages == 2 or None, "both dropped")
        finally:
            sock.close(linger=0)
            ctx.term()
        assert registry.status()["members"] == []


# -- in one process ------------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_the_status_reply_marks_the_rank_the_others_wait_for():
    config = CommConfig(progress_after=0.5, timeout=60)
    registry = RegistryConfig(heartbeat_interval=0.1, heartbeat_timeout=10)
    async with open_local_cluster(4, config=config, registry_config=registry) as cluster:
        for _ in range(2):
            await cluster.run(lambda c: c.all_reduce(np.ones(256)))  # collectives #1, #2
        waiting = [c.all_reduce(np.ones(256)) for c in cluster.comms if c.rank != STUCK]

        def probed() -> dict[str, Any] | None:
            status = cluster.registry.status()
            others = [m for m in status["members"] if m["rank"] != STUCK]
            done = all((m["progress"] or {}).get("waiting_for") is not None for m in others)
            return status if done else None

        status = await _until(probed, "every waiting rank's heartbeat names whom it waits for")
        await cluster.comms[STUCK].all_reduce(np.ones(256))  # collective #3, at last
        await asyncio.gather(*waiting)
    assert status["waited_for"] == [STUCK]
    by_rank = {m["rank"]: m for m in status["members"]}
    assert by_rank[STUCK]["waited_by"] == [0, 1, 3]
    for rank in (0, 1, 3):
        progress = by_rank[rank]["progress"]
        assert progress["call"][:2] == [3, "all_reduce"]
        assert progress["waiting_for"] == [STUCK]
        assert progress["waiting_n"] == 1
        assert progress["sampled"] == 2  # its two calls that ended
        assert by_rank[rank]["waited_by"] == []
    assert by_rank[STUCK]["progress"]["call"] is None
    assert by_rank[STUCK]["started"][1] == 2
    assert [v["reason"] for v in status["views"]] == ["formed with 4 members"]
    text = render(cluster.registry.address, status)
    stuck_lines = [line for line in text.splitlines() if "STUCK" in line]
    assert len(stuck_lines) == 1
    assert re.match(r"\*\s+2\s", stuck_lines[0]), stuck_lines
    assert stuck_lines[0].endswith("<< STUCK: ranks 0, 1, 3 wait for it")


@pytest.mark.timeout(60)
async def test_a_rank_the_others_wait_for_on_every_call_is_marked_a_straggler():
    registry = RegistryConfig(heartbeat_interval=0.05, heartbeat_timeout=10)
    calls = 12
    async with open_local_cluster(4, registry_config=registry) as cluster:

        async def rank_2_slow(comm: Any) -> None:
            for _ in range(calls):
                if comm.rank == STUCK:
                    await asyncio.sleep(0.05)  # a slow step: the others wait for it each call
                await comm.all_reduce(np.ones(256))

        await cluster.run(rank_2_slow)

        def reported() -> dict[str, Any] | None:
            status = cluster.registry.status()
            done = all((m["progress"] or {}).get("sampled") == calls for m in status["members"])
            return status if done else None

        status = await _until(reported, f"heartbeats reporting the {calls} calls")
    table = rows(status)
    assert [r.rank for r in table if r.straggler] == [STUCK], [r.p50_s for r in table]
    assert not any(r.stuck for r in table)
    slow = table[STUCK]
    assert slow.straggles_s is not None
    assert slow.straggles_s >= STRAGGLER_RATIO * slow.p50_s["waiting"]
    line = next(x for x in render("tcp://x:1", status).splitlines() if "STRAGGLER" in x)
    assert re.match(r"~\s+2\s", line), line
    assert "<tr id='rank-2' class='straggler'" in page("x", status, "", 0.0, {}, 1.0)
    marks = json.loads(json.dumps(with_marks(status)))["marks"]  # as --json prints it
    assert marks == {"stuck": {}, "stragglers": {"2": slow.straggles_s}}


def test_ranks_that_wait_alike_are_no_stragglers():
    members = [member(r, 40, summary() | {"sampled": 32}) for r in range(4)]
    assert not any(r.straggler for r in rows({"members": members}))


@pytest.mark.timeout(60)
async def test_a_progress_summary_is_small_and_follows_the_calls():
    registry = RegistryConfig(heartbeat_interval=0.05, heartbeat_timeout=10)
    async with open_local_cluster(2, registry_config=registry) as cluster:
        for _ in range(5):
            await cluster.run(lambda c: c.all_reduce(np.ones(64)))

        def summaries() -> list[dict[str, Any]] | None:
            got = [m["progress"] for m in cluster.registry.status()["members"]]
            return got if all(p and p["sampled"] == 5 for p in got) else None

        for progress in await _until(summaries, "heartbeats reporting the 5 calls"):
            assert progress["call"] is None
            assert progress["waiting_for"] is None
            assert progress["calls_per_s"] > 0
            total, *parts = progress["p50_us"]
            assert total > 0
            assert all(p >= 0 for p in parts)
            assert len(msgpack.packb(progress)) < 100  # bytes added to each heartbeat


async def _until(get: Callable[[], Any], what: str, within: float = 30.0) -> Any:
    async with asyncio.timeout(within):
        while (found := get()) is None:  # noqa: ASYNC110 (heartbeats: no event to wait on)
            await asyncio.sleep(0.05)
    assert found is not None, what
    return found


def test_the_page_escapes_what_the_registry_says_and_marks_the_stuck_row():
    members = [
        member(0, 4, summary([4, "all_reduce", 6.0], [1])),
        member(1, 3, summary()) | {"id": "<b>bold</b>"},
    ]
    waited = mark_waited_for(members, slow_s=1.0)
    reason = "<script>alert(1)</script>"
    status = {"formed": True, "members": members, "waited_for": waited, "views": []}
    status["views"] = [{"epoch": 1, "at": 0.0, "size": 2, "reason": reason}]
    text = page("tcp://127.0.0.1:1", status, "", time.time(), {}, 1.0)
    assert "<script>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "&lt;b&gt;bold&lt;/b&gt;" in text
    assert re.search(r"<tr id='rank-1' class='stuck' data-stuck='true'>", text)
    assert re.search(r"<tr id='rank-0' class='ok' data-stuck='false'>", text)


@pytest.mark.timeout(60)
async def test_the_page_server_answers_get_and_head_only_with_no_script_allowed():
    registry = RegistryConfig(heartbeat_interval=0.05, heartbeat_timeout=10)
    async with open_local_cluster(2, registry_config=registry) as cluster:
        await cluster.run(lambda c: c.all_reduce(np.ones(8)))
        poller = StatusPoller(cluster.registry.address, 0.1, 2.0).start()
        server = serve(poller, "127.0.0.1", 0)
        thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        try:

            def polled() -> Any:
                return poller.latest()[0].get("members") or None

            await _until(polled, "the poller's first answer")
            code, headers, body = await asyncio.to_thread(fetch, url)
            assert code == 200
            assert headers["Content-Security-Policy"].startswith("default-src 'none'")
            assert "<tr id='rank-0'" in body
            assert "<tr id='rank-1'" in body
            code, _, body = await asyncio.to_thread(fetch, url + "status.json")
            assert (code, json.loads(body)["formed"]) == (200, True)
            assert (await asyncio.to_thread(fetch, url + "elsewhere"))[0] == 404
            assert (await asyncio.to_thread(fetch, url, "POST"))[0] == 501
            code, _, body = await asyncio.to_thread(fetch, url, "HEAD")
            assert (code, body) == (200, "")
        finally:
            server.shutdown()
            server.server_close()
            await asyncio.to_thread(poller.stop)
            thread.join(timeout=10)


def fetch(url: str, method: str = "GET") -> tuple[int, dict[str, str], str]:
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, dict(answer.headers), answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), ""


def test_serve_refuses_an_address_that_is_not_host_port():
    done = subprocess.run(
        [*DSML, "status", "--registry", "tcp://127.0.0.1:9", "--serve", "localhost:80x"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert done.returncode == 1
    assert "--serve localhost:80x: give HOST:PORT with an IP address" in done.stderr


# -- through the dsml command ---------------------------------------------------------------


def registry_process() -> contextlib.AbstractContextManager[str]:
    """A `dsml registry` (heartbeats every 0.2 s) on a free port; yields its address."""
    return dsml_registry("--heartbeat-interval", "0.2")


@contextlib.contextmanager
def held_job(address: str, release: Path) -> Iterator[subprocess.Popen[str]]:
    """`dsml run -n 4 status_hang.py`: rank 2 holds #3 back until `release` exists; on the
    way out, releases it and checks the job ended well."""
    env = {**os.environ, "RELEASE": str(release), "DSML_PROGRESS_AFTER": "0.5"}
    env.pop("DSML_REGISTRY", None)
    proc = subprocess.Popen(
        [*DSML, "run", "-n", "4", "--registry", address, str(SCRIPT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        yield proc
    finally:
        release.touch()
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert sorted(re.findall(r"rank (\d): done", out)) == ["0", "1", "2", "3"], out


def status_json(address: str) -> dict[str, Any]:
    done = subprocess.run(
        [*DSML, "status", "--registry", address, "--json"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    return json.loads(done.stdout) if done.returncode == 0 else {}


def wait_until_stuck(get: Callable[[], dict[str, Any]], within: float = 60.0) -> dict[str, Any]:
    """Poll a status reply until the waiting ranks' probes named rank 2."""
    deadline = time.monotonic() + within
    while True:
        status = get()
        others = [m for m in status.get("members", []) if m["rank"] != STUCK]
        if len(others) == 3 and all(
            (m.get("progress") or {}).get("waiting_for") == [STUCK] for m in others
        ):
            return status
        assert time.monotonic() < deadline, f"rank 2 never seen stuck: {status}"
        time.sleep(0.2)


class Lines:
    """The output lines of a process, read by a thread (waits have deadlines)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self._lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        assert proc.stdout is not None
        stream = proc.stdout
        threading.Thread(target=lambda: [self._lines.put(x) for x in stream], daemon=True).start()

    def wait_for(self, predicate: Callable[[str], bool], within: float = 60.0) -> str:
        deadline = time.monotonic() + within
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError("not seen:\n" + "".join(self.seen[-40:])) from None
            self.seen.append(line)
            if predicate(line):
                return line


@contextlib.contextmanager
def dsml_status(*options: str) -> Iterator[tuple[subprocess.Popen[str], Lines]]:
    """A refreshing `dsml status`; stopped by SIGTERM, after which it must exit 0."""
    proc = subprocess.Popen(
        [*DSML, "status", *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    try:
        yield proc, Lines(proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_status_and_watch_mark_rank_2_while_it_holds_a_collective_back(tmp_path: Path):
    with registry_process() as address, held_job(address, tmp_path / "release"):
        status = wait_until_stuck(lambda: status_json(address))
        assert status["waited_for"] == [STUCK]
        assert status["marks"] == {"stuck": {"2": [0, 1, 3]}, "stragglers": {}}
        by_rank = {m["rank"]: m for m in status["members"]}
        assert by_rank[STUCK]["waited_by"] == [0, 1, 3]
        assert by_rank[STUCK]["progress"]["call"] is None
        for rank in (0, 1, 3):
            assert by_rank[rank]["progress"]["call"][:2] == [3, "all_reduce"]
        with dsml_status("--registry", address, "--watch", "--interval", "0.3") as (_, lines):
            marked = lines.wait_for(lambda line: "STUCK" in line)
            assert re.match(r"\*\s+2\s", marked), marked
            assert "idle (last #2 all_reduce)" in marked
            assert marked.rstrip().endswith("<< STUCK: ranks 0, 1, 3 wait for it")
            row_0 = lines.wait_for(lambda line: re.match(r"\s+0\s", line) is not None)
            assert "#3 all_reduce for " in row_0
            assert "STUCK" not in row_0


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.skipif(
    _chromium() is None,
    reason="no chromium on PATH (Debian: apt-get install chromium); the page is not loaded",
)
def test_the_status_page_in_headless_chromium_marks_the_stuck_rank(tmp_path: Path):
    with (
        registry_process() as address,
        held_job(address, tmp_path / "release"),
        dsml_status("--registry", address, "--serve", "127.0.0.1:0", "--interval", "0.3") as (
            _,
            lines,
        ),
    ):
        serving = lines.wait_for(lambda line: "serving http://" in line)
        found = re.search(r"(http://127\.0\.0\.1:\d+/)(\w+/) ", serving)
        assert found is not None, serving
        url = found[1] + found[2]
        assert fetch(found[1])[0] == 404  # without the secret's path: nothing

        def page_data() -> dict[str, Any]:
            with urllib.request.urlopen(url + "status.json", timeout=10) as answer:
                return json.loads(answer.read())

        wait_until_stuck(page_data)
        dom = dump_dom(url, tmp_path / "profile")
    rows = dict(re.findall(r'<tr id="rank-(\d)" class="(\w+)"', dom))
    assert rows == {"0": "ok", "1": "ok", "2": "stuck", "3": "ok"}, dom
    row_2 = re.search(r'<tr id="rank-2".*?</tr>', dom, re.S)
    assert row_2 is not None
    assert "STUCK: ranks 0, 1, 3 wait for it" in row_2[0]
    assert 'id="verdict" class="stuck">stuck: rank 2<' in dom
    assert "formed with 4 members" in dom  # the recent views


def dump_dom(url: str, profile: Path) -> str:
    """The page's DOM after Chromium loaded it (headless; its own process group, killed
    whole if it hangs)."""
    proc = subprocess.Popen(
        [
            str(_chromium()),
            "--headless",
            "--no-sandbox",  # as root in a container
            "--disable-gpu",
            f"--user-data-dir={profile}",
            "--dump-dom",
            url,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert proc.returncode == 0, err[-2000:]
    return out
