"""dsml against torch.distributed (Gloo) on 4 namespaced hosts with shaped links.

    sudo python benchmarks/multihost.py                          # 1gbit and 10gbit, 3 repeats
    sudo python benchmarks/multihost.py --rates 1gbit --sizes 4K,1M,16M --repeat 5 --json out.json
    sudo python benchmarks/multihost.py --rates 10gbit --sizes 16M --baseline DIR  # A/B

Builds `--hosts` network namespaces on one bridge (dsml.testing.netns: every link shaped
both ways with tbf), one rank per host, and for each rate runs, `--repeat` times and
interleaved (dsml, Gloo, dsml, Gloo, ...): every dsml algorithm (`auto` and each one by
name, all in one group) and Gloo at every size. Prints per size the median over repeats of
each side's median call time, the spread over repeats, the 10th-90th percentiles of every
timed call of every repeat (the line below each size), the bus bandwidth, `auto` against
the best dsml algorithm (`auto/best`: of the medians over repeats; `paired`: within each
repeat, median over repeats), and Gloo's time over `auto`'s (> 1: dsml faster); and the
cost model `auto` measured, with how long its probe took. With `--baseline DIR` each
repeat also runs dsml imported from DIR (another checkout: before/after in one run), in
columns prefixed `base-`. Needs root,
iproute2 and torch; the namespaces are removed on exit. The hosts share this machine's
CPUs, so at 10 Gbit the CPU, not the link, is the limit.
A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from dsml.collectives.cost import CostModel  # noqa: E402
from dsml.testing.netns import NetnsHosts, netns_hosts, unavailable_reason  # noqa: E402

ALGORITHMS = "auto,ring,mesh,tree,naive,direct"
SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"
WORKER = str(HERE / "multihost_worker.py")
BASE = "base-"  # the prefix of --baseline's columns
PORT = 29517  # the namespaces are ours alone: any fixed port is free there


def parse_size(text: str) -> int:
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(text[:-1]) * scale[text[-1]] if text[-1] in scale else int(text)


def tagged(out: str, tag: str) -> list[dict[str, Any]]:
    return [json.loads(line[len(tag) :]) for line in out.splitlines() if line.startswith(tag)]


def run_ranks(hosts: NetnsHosts, argv: list[str], env_of: Any, timeout_s: float) -> str:
    """Run argv on every host (env_of(rank) added); returns rank 0's standard output."""
    procs = []
    for rank, host in enumerate(hosts):
        env = {**os.environ, "OMP_NUM_THREADS": "1", **env_of(rank)}
        procs.append(
            host.popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout_s)
            if proc.returncode != 0:
                raise RuntimeError(f"{argv[1:3]} failed ({proc.returncode}):\n{err[-3000:]}")
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs[0]


def dsml_group(hosts: NetnsHosts, argv: list[str], pythonpath: str = "") -> str:
    """Run argv as one dsml group, a rank per host (registry on host 0); rank 0's output."""
    address = f"tcp://{hosts[0].address}:{PORT}"
    registry = hosts[0].popen(
        [sys.executable, "-m", "dsml", "registry", "--address", address],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **({"PYTHONPATH": pythonpath} if pythonpath else {})},
        cwd=pythonpath or None,  # `python -m` imports from the working directory first
    )
    try:
        assert registry.stdout is not None
        line = registry.stdout.readline()  # "dsml registry serving on ..."
        if "serving" not in line:
            raise RuntimeError(f"the registry did not start: {line!r}")
        return run_ranks(
            hosts,
            argv,
            lambda r: {
                "DSML_REGISTRY": address,
                "DSML_WORLD_SIZE": str(len(hosts)),
                "DSML_RANK": str(r),
                "DSML_BIND": f"tcp://{hosts[r].address}:0",
                **({"PYTHONPATH": pythonpath} if pythonpath else {}),
            },
            timeout_s=1800,
        )
    finally:
        registry.terminate()
        registry.wait(timeout=10)


def dsml_run(
    hosts: NetnsHosts,
    sizes: list[int],
    algorithms: str,
    budget: float,
    chunk_bytes: int = 0,
    pythonpath: str = "",
) -> str:
    """Every algorithm at every size in one group of len(hosts) ranks (dsml imported from
    `pythonpath` when given: another checkout, for a before/after comparison)."""
    argv = [sys.executable, WORKER, "dsml", "--sizes", ",".join(map(str, sizes))]
    argv += ["--algorithms", algorithms, "--budget", str(budget)]
    argv += ["--chunk-bytes", str(chunk_bytes)] if chunk_bytes else []
    return dsml_group(hosts, argv, pythonpath)


def gloo_run(hosts: NetnsHosts, sizes: list[int], budget: float) -> str:
    argv = [sys.executable, WORKER, "gloo", "--sizes", ",".join(map(str, sizes))]
    argv += ["--master", f"{hosts[0].address}:{PORT + 1}", "--budget", str(budget)]
    return run_ranks(
        hosts,
        argv,
        lambda r: {"RANK": str(r), "WORLD_SIZE": str(len(hosts)), "GLOO_SOCKET_IFNAME": "eth0"},
        timeout_s=1800,
    )


def summarize(rate: str, rows: list[dict[str, Any]], models: list[dict[str, Any]]) -> None:
    """Print one table for one rate from the rows of every repeat."""
    runs: dict[tuple[int, str], list[float]] = defaultdict(list)
    chosen: dict[int, set[str]] = defaultdict(set)
    for r in rows:
        runs[(r["bytes"], r["algorithm"])].append(r["median_s"])
        if r["algorithm"] == "auto":
            chosen[r["bytes"]].add(f"{r['chosen']}/{r['chunk_bytes'] >> 10}K")
    algorithms = ALGORITHMS.split(",")
    known = [*algorithms, *(f"{BASE}{a}" for a in algorithms), "gloo"]
    names = [n for n in known if any(k[1] == n for k in runs)]
    world = rows[0]["world_size"] if rows else 0
    print(f"\n## {rate}, {world} hosts: median ms over repeats (spread = (max-min)/median)")
    for m in models[:1]:
        fields = {k: v for k, v in m.items() if k != "probe_s"}
        print(f"# measured model: {CostModel.from_fields(fields).describe()}")
    probes = [m["probe_s"] for m in models if "probe_s" in m]
    if probes:
        print(f"# the probe (first auto call) took {', '.join(f'{s:.2f}' for s in probes)} s")
    print(
        f"# {'bytes':>9} "
        + " ".join(f"{n:>14}" for n in names)
        + f" {'auto busbw':>10} {'auto/best':>9} {'paired':>6} {'gloo/auto':>9}  auto chose"
    )
    pooled: dict[tuple[int, str], list[float]] = defaultdict(list)
    for r in rows:
        pooled[(r["bytes"], r["algorithm"])] += r.get("times_s", [])
    for nbytes in sorted({k[0] for k in runs}):
        med = {n: statistics.median(runs[(nbytes, n)]) for n in names if runs[(nbytes, n)]}
        cells = []
        for n in names:
            ts = runs.get((nbytes, n))
            if not ts:
                cells.append(f"{'-':>14}")
                continue
            spread = (max(ts) - min(ts)) / med[n] * 100
            cells.append(f"{med[n] * 1e3:>8.2f} ±{spread:>3.0f}%")
        best_name = min((n for n in med if n in algorithms and n != "auto"), key=med.__getitem__)
        dsml_best = med[best_name]
        auto = med.get("auto", float("nan"))
        paired = _paired(rows, nbytes, best_name)
        busbw = nbytes / auto / 1e9 * 2 * (world - 1) / world
        gloo = med.get("gloo", float("nan"))
        print(
            f"  {nbytes:>9} "
            + " ".join(cells)
            + f" {busbw:>10.4f} {auto / dsml_best:>9.2f} {paired:>6.2f} {gloo / auto:>9.2f}  "
            + ",".join(sorted(chosen[nbytes]))
        )
        quantiles = [_quantiles(pooled.get((nbytes, n), [])) for n in names]
        print(f"  {'':>9} " + " ".join(f"{q:>14}" for q in quantiles) + "  (every call: p10-p90)")


def _paired(rows: list[dict[str, Any]], nbytes: int, best: str) -> float:
    """auto against the best dsml algorithm within each repeat (their calls interleaved),
    median over repeats: free of the drift between repeats that `auto/best` (medians over
    repeats, the best being the lowest of several noisy medians) carries."""
    repeats: dict[int, dict[str, float]] = defaultdict(dict)
    for r in rows:
        if r["bytes"] == nbytes and r["algorithm"] in ("auto", best):
            repeats[r.get("repeat", 0)][r["algorithm"]] = r["median_s"]
    ratios = [t["auto"] / t[best] for t in repeats.values() if len(t) == 2]
    return statistics.median(ratios) if ratios else float("nan")


def _quantiles(times: list[float]) -> str:
    """'p10-p90' in ms of every timed call of every repeat ('-' without per-call times)."""
    if not times:
        return "-"
    p10, p90 = (float(v) * 1e3 for v in np.percentile(times, [10, 90]))
    return f"{p10:.1f}-{p90:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rates", default="1gbit,10gbit")
    parser.add_argument("--sizes", default=SIZES)
    parser.add_argument("--algorithms", default=ALGORITHMS)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--budget", type=float, default=1.5, help="seconds per measurement")
    parser.add_argument("--no-gloo", action="store_true")
    parser.add_argument(
        "--baseline",
        default="",
        help="also run dsml from this checkout (its columns are prefixed 'base-')",
    )
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        sys.exit(f"multihost: {reason}")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    everything: dict[str, Any] = {}
    with netns_hosts(args.hosts, rate=args.rates.split(",")[0]) as hosts:
        for rate in args.rates.split(","):
            hosts.set_rate(rate)
            rows: list[dict[str, Any]] = []
            models: list[dict[str, Any]] = []
            for rep in range(args.repeat):  # interleaved: a noisy minute hurts both sides
                start = time.perf_counter()
                out = dsml_run(hosts, sizes, args.algorithms, args.budget)
                rows += [{**r, "repeat": rep} for r in tagged(out, "MULTIHOST_ROW ")]
                if args.baseline:
                    out = dsml_run(hosts, sizes, args.algorithms, args.budget, 0, args.baseline)
                    rows += [
                        {**r, "algorithm": BASE + r["algorithm"], "repeat": rep}
                        for r in tagged(out, "MULTIHOST_ROW ")
                    ]
                models += tagged(out, "MULTIHOST_MODEL ")
                if not args.no_gloo:
                    out = gloo_run(hosts, sizes, args.budget)
                    rows += [{**r, "repeat": rep} for r in tagged(out, "MULTIHOST_ROW ")]
                print(
                    f"# {rate} repeat {rep + 1}/{args.repeat}: {time.perf_counter() - start:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
            everything[rate] = {"rows": rows, "models": models}
            summarize(rate, rows, models)
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
