"""dsml against torch Gloo and MPICH (mpi4py), interleaved, on one host (a benchmark).

    python benchmarks/peers.py -n 4 --sizes 4K,64K,1M,16M,64M --repeat 5
    python benchmarks/peers.py -n 4 --algorithms shm,auto --sides dsml,mpi
    python benchmarks/peers.py -n 2 --sizes 16M --sides dsml,base,mpi --baseline DIR

Every repeat runs each side once, in turn (dsml, Gloo, MPICH, dsml, Gloo, ...), so a noisy
minute on a shared machine hurts all of them. Inside a run, each size is timed the same way
on every side: warm-up calls, then timed calls each preceded by a barrier; a call's time is
the slowest rank's and the run reports the median call. Across repeats the table shows the
median run with p10/p90, and dsml's speed relative to each peer (peer time / dsml time, so
above 1 means dsml is faster). A benchmark: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import bench_rows, dsml, tagged_lines

HERE = Path(__file__).resolve().parent
SIDES = ("dsml", "gloo", "mpi")  # also "base", with --baseline


def iterations(nbytes: int) -> int:
    """Timed calls per size (the same table as `dsml bench`)."""
    if nbytes <= 64 * 1024:
        return 50
    if nbytes <= 1 << 20:
        return 30
    if nbytes <= 16 << 20:
        return 12
    return 6


def mpi_worker(sizes: list[int]) -> None:
    """One rank of the MPICH side (run under mpiexec)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    for nbytes in sizes:
        x = np.zeros(nbytes // 4, dtype=np.float32)
        out = np.empty_like(x)
        iters = iterations(nbytes)
        for _ in range(max(2, iters // 5)):
            comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
        times = np.empty(iters)
        for i in range(iters):
            comm.Barrier()
            start = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
            times[i] = time.perf_counter() - start
        comm.Allreduce(times.copy(), times, op=MPI.MAX)
        del out
        if comm.rank == 0:
            row = {"bytes": nbytes, "algorithm": "mpich", "median_s": float(np.median(times))}
            print("MPI_ROW " + json.dumps(row), flush=True)


def mpi_rows(n: int, sizes: list[int]) -> list[dict[str, Any]]:
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        print("# mpiexec not found: MPICH side skipped (pip install mpich mpi4py)", file=sys.stderr)
        return []
    cmd = [mpiexec, "-n", str(n), sys.executable, __file__, "--mpi-worker", _csv(sizes)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return [json.loads(line) for line in tagged_lines(out, "MPI_ROW")]


def gloo_rows(n: int, sizes: list[int]) -> list[dict[str, Any]]:
    try:
        import torch  # noqa: F401
    except ImportError:
        print("# torch is not installed: Gloo side skipped", file=sys.stderr)
        return []
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    worker = str(HERE / "gloo_worker.py")
    out = dsml("run", "-n", str(n), worker, _csv(sizes), port, env={"OMP_NUM_THREADS": "1"})
    rows = [json.loads(line) for line in tagged_lines(out, "GLOO_ROW")]
    return [{**r, "algorithm": "gloo"} for r in rows]


def dsml_rows(
    n: int, sizes: list[int], algorithms: str, checkout: str | None = None
) -> list[dict[str, Any]]:
    """dsml's rows; with `checkout`, of the dsml in that directory (named `base:...`)."""
    env = None
    name = "dsml"
    if checkout is not None:
        checkout = os.path.abspath(checkout)
        path = os.environ.get("PYTHONPATH", "")
        env = {"PYTHONPATH": os.pathsep.join(p for p in (checkout, path) if p)}
        name = "base"
    rows = bench_rows(n, _csv(sizes), algorithms, env=env, cwd=checkout)
    return [{**r, "algorithm": f"{name}:{r['algorithm']}"} for r in rows]


def _csv(sizes: list[int]) -> str:
    return ",".join(map(str, sizes))


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def summary(runs: list[list[dict[str, Any]]]) -> dict[tuple[int, str], tuple[float, ...]]:
    """Per (bytes, name): (median, p10, p90) of the runs' median call times."""
    times: dict[tuple[int, str], list[float]] = {}
    for run in runs:
        for row in run:
            times.setdefault((row["bytes"], row["algorithm"]), []).append(row["median_s"])
    return {
        key: tuple(float(np.percentile(v, q)) for q in (50, 10, 90)) for key, v in times.items()
    }


def table(n: int, repeats: int, stats: dict[tuple[int, str], tuple[float, ...]]) -> str:
    lines = [
        f"# world_size={n}, float32 sum, {repeats} interleaved repeat(s); time of one call "
        "(median run, [p10, p90]) in us; speed = peer's time / dsml's time",
        f"# {'bytes':>10} {'side':>16} {'median':>10} {'p10':>10} {'p90':>10} "
        f"{'vs gloo':>8} {'vs mpich':>9}",
    ]
    for nbytes in sorted({k[0] for k in stats}):
        names = sorted(k[1] for k in stats if k[0] == nbytes)
        gloo = stats.get((nbytes, "gloo"))
        mpich = stats.get((nbytes, "mpich"))
        for name in names:
            med, p10, p90 = stats[(nbytes, name)]
            vs = ["", ""]
            if name.startswith(("dsml", "base")):
                vs = [f"{peer[0] / med:.2f}x" if peer else "-" for peer in (gloo, mpich)]
            lines.append(
                f"  {nbytes:>10} {name:>16} {med * 1e6:>10.1f} {p10 * 1e6:>10.1f} "
                f"{p90 * 1e6:>10.1f} {vs[0]:>8} {vs[1]:>9}"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=4)
    parser.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    parser.add_argument("--algorithms", default="auto", help="dsml algorithms (comma list)")
    parser.add_argument("--sides", default=",".join(SIDES), help="which of dsml,gloo,mpi,base")
    parser.add_argument("--baseline", help="a dsml checkout for the `base` side (A/B)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--mpi-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mpi_worker:
        mpi_worker([int(s) for s in args.mpi_worker.split(",")])
        return
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    sides = args.sides.split(",")
    if "base" in sides and not args.baseline:
        parser.error("the base side needs --baseline DIR (another dsml checkout)")
    runs: list[list[dict[str, Any]]] = []
    for i in range(args.repeat):
        for side in sides:
            if side == "dsml":
                runs.append(dsml_rows(args.n, sizes, args.algorithms))
            elif side == "base":
                runs.append(dsml_rows(args.n, sizes, args.algorithms, args.baseline))
            elif side == "gloo":
                runs.append(gloo_rows(args.n, sizes))
            elif side == "mpi":
                runs.append(mpi_rows(args.n, sizes))
        print(f"# repeat {i + 1}/{args.repeat} done", file=sys.stderr, flush=True)
    stats = summary(runs)
    if args.json:
        rows = [
            {"bytes": b, "side": s, "median_s": v[0], "p10_s": v[1], "p90_s": v[2]}
            for (b, s), v in sorted(stats.items())
        ]
        print(json.dumps({"world_size": args.n, "repeats": args.repeat, "rows": rows}, indent=2))
        return
    print(table(args.n, args.repeat, stats))


if __name__ == "__main__":
    main()
