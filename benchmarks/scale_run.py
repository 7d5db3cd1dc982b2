"""Cost of one group against its size, on one host (a benchmark; docs/scale.md).

    dsml run -n 64 benchmarks/scale_run.py
    dsml run -n 16 benchmarks/scale_run.py --idle 6 --no-collectives

Each rank: init, barrier, 20 all_reduces of 4 KiB and of 1 MiB (each preceded by a
barrier; a call's time is this rank's), then `--idle` seconds with nothing to do, during
which it counts the `PeerBeat` messages it sends (peer watch), then its resident memory
and open file descriptors from /proc/self. Rank 0 gathers every rank's figures and prints
one JSON line. "formed" is the time from the first rank's process start to the last
rank's return from `dsml.init()`. A benchmark: nothing here asserts a time.

With `--kill FILE`, the last rank then writes the time into FILE and kills itself with
SIGKILL while the others are in an all_reduce; each survivor notes when its call failed,
and the survivors (in their new view) print how long after the kill they saw it (run it
with `dsml run --grace 60`: the launcher stops the survivors once it sees the death, and
they ignore its SIGINT to report first).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from pathlib import Path

import numpy as np

T0 = time.time()  # this process's start, near enough: before dsml is imported

import dsml  # noqa: E402
from dsml.communicator import links as _links  # noqa: E402
from dsml.wire import Kind  # noqa: E402

_beats = [0]
_try_send = _links.PeerLinks.try_send


def _counting_try_send(self, peer, env, payload=()):  # type: ignore[no-untyped-def]
    if env.kind is Kind.PEER_BEAT:
        _beats[0] += 1
    return _try_send(self, peer, env, payload)


_links.PeerLinks.try_send = _counting_try_send  # type: ignore[method-assign]


def process_start() -> float:
    """Wall-clock time this process started (from /proc)."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    lines = Path("/proc/stat").read_text().splitlines()
    btime = next(int(line.split()[1]) for line in lines if line.startswith("btime"))
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def main(args: argparse.Namespace) -> None:
    start = min(process_start(), T0)
    comm = await dsml.init()
    formed = time.time()
    try:
        await comm.barrier()
        p50 = {}
        for nbytes in (4 << 10, 1 << 20) if args.collectives else ():
            x = np.ones(nbytes // 4, dtype=np.float32)
            times = []
            for _ in range(20):
                await comm.barrier()
                t = time.perf_counter()
                await comm.all_reduce(x)
                times.append(time.perf_counter() - t)
            p50[nbytes] = float(np.median(times))
        await comm.barrier()
        before = _beats[0]
        t = time.monotonic()
        await asyncio.sleep(args.idle)
        beats_per_s = (_beats[0] - before) / (time.monotonic() - t)
        fds = len(os.listdir("/proc/self/fd"))
        row = np.array(
            [
                start,
                formed,
                rss_bytes(),
                fds,
                beats_per_s,
                p50.get(4096, 0),
                p50.get(1 << 20, 0),
                comm.epoch,
            ]
        )
        rows = (await comm.all_gather(row[None, :])).reshape(-1, row.size)
        if comm.rank == 0:
            print(json.dumps(summary(rows)), flush=True)
        await comm.barrier()
        if args.kill:
            await kill_one(comm, Path(args.kill))
    finally:
        await comm.aclose()


async def kill_one(comm: dsml.Communicator, note: Path) -> None:
    """The last rank dies by SIGKILL in an all_reduce; the others report when they saw it."""
    victim = comm.world_size - 1
    x = np.ones(1024, dtype=np.float32)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher's, once it saw the death
    if comm.rank == victim:
        await asyncio.sleep(0.5)  # the others are in the call by then
        await asyncio.to_thread(note.write_text, repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        await comm.all_reduce(x, timeout=60)
    except dsml.MembershipChangedError as exc:
        seen = time.time()
        kind = type(exc).__name__
    else:
        raise AssertionError("the call succeeded without the killed rank")
    while comm.world_size == victim + 1:  # the new view may come after the failure
        await comm.wait_view_change(timeout=60)
    delay = seen - float(await asyncio.to_thread(note.read_text))
    delays = await comm.all_gather(np.array([delay]))
    if comm.rank == 0:
        report = {
            "kill_seen_by": int(delays.size),
            "kill_seen_s_median": round(float(np.median(delays)), 3),
            "kill_seen_s_max": round(float(delays.max()), 3),
            "error": kind,
        }
        print(json.dumps(report), flush=True)


def summary(rows: np.ndarray) -> dict[str, float]:
    """The group's figures from every rank's row."""
    return {
        "n": int(rows.shape[0]),
        "formed_s": round(float(rows[:, 1].max() - rows[:, 0].min()), 2),
        "rss_mb_median": round(float(np.median(rows[:, 2])) / 1e6, 1),
        "rss_mb_max": round(float(rows[:, 2].max()) / 1e6, 1),
        "fds_median": int(np.median(rows[:, 3])),
        "fds_max": int(rows[:, 3].max()),
        "beats_per_rank_s_median": round(float(np.median(rows[:, 4])), 2),
        "beats_per_rank_s_max": round(float(rows[:, 4].max()), 2),
        "allreduce_4k_p50_ms": round(float(np.median(rows[:, 5])) * 1e3, 2),
        "allreduce_1m_p50_ms": round(float(np.median(rows[:, 6])) * 1e3, 2),
        "epoch": int(rows[:, 7].max()),  # 1 unless the view changed during the run
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", type=float, default=5.0, help="seconds idle (beats)")
    parser.add_argument("--no-collectives", dest="collectives", action="store_false")
    parser.add_argument("--kill", metavar="FILE", help="kill the last rank (see above)")
    asyncio.run(main(parser.parse_args()))
