"""`dsml bench`: all_reduce time and bandwidth, nccl-tests style (cli layer).

Runs N ranks on this machine (through the same launcher as `dsml run`) and prints, per size
and algorithm, the median time of one all_reduce, the algorithm bandwidth (bytes / time)
and the bus bandwidth (algbw x 2(P-1)/P, comparable across world sizes). Arrays are numpy,
or cupy with `--device cuda` (rank i on GPU i modulo the GPU count).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from ..collectives import ALL_REDUCE_ALGORITHMS, DTYPES, check_op
from ..config import parse_size
from ..errors import ConfigError
from .run import check_device, launch

__all__ = ["add_parser", "format_table"]

DEFAULT_SIZES = "4K,64K,1M,16M,64M"
#: rank 0 of the workers prints each measurement as this prefix and one JSON object
ROW_PREFIX = "DSML_BENCH_ROW "


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "bench",
        help="measure all_reduce time and bandwidth",
        description="Measure all_reduce between N local ranks (nccl-tests style table).",
    )
    parser.add_argument("-n", "--nprocs", type=int, default=4, help="ranks (default: 4)")
    parser.add_argument(
        "--sizes", default=DEFAULT_SIZES, help="comma-separated (default: %(default)s)"
    )
    parser.add_argument("--op", default="sum", help="reduce op (default: sum)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument(
        "--algorithm",
        default="auto",
        help="auto, ring, tree, naive, a comma-separated list, or all (default: auto)",
    )
    parser.add_argument(
        "--iters", type=int, default=0, help="timed calls per size (default: by size)"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu (numpy arrays) or cuda (cupy arrays, rank i on GPU i modulo the GPU count)",
    )
    parser.add_argument("--registry", help="an existing registry (default: embedded)")
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows")
    parser.set_defaults(handler=_main)


def _algorithms(text: str) -> list[str]:
    names = ["auto", *ALL_REDUCE_ALGORITHMS] if text == "all" else text.split(",")
    for name in names:
        if name != "auto" and name not in ALL_REDUCE_ALGORITHMS:
            raise ConfigError(f"unknown algorithm {name!r}")
    return names


def _main(args: argparse.Namespace) -> int:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    check_op(args.op, args.dtype)
    algorithms = _algorithms(args.algorithm)
    if args.nprocs < 1:
        raise ConfigError("-n must be at least 1")
    device = check_device(args.device)
    argv = [
        sys.executable,
        "-m",
        "dsml.cli.bench_worker",
        "--sizes",
        ",".join(map(str, sizes)),
        "--algorithms",
        ",".join(algorithms),
        "--op",
        args.op,
        "--dtype",
        args.dtype,
        "--iters",
        str(args.iters),
    ]
    rows: list[dict[str, Any]] = []

    def on_line(rank: int, stream: str, line: str) -> None:
        if stream == "stdout" and line.startswith(ROW_PREFIX):
            rows.append(json.loads(line[len(ROW_PREFIX) :]))
            if not args.json:
                print(format_row(rows[-1]), flush=True)
        else:
            print(f"[rank {rank}] {line}", file=sys.stderr if stream == "stderr" else sys.stdout)

    if not args.json:
        print(header(args.nprocs, args.op, args.dtype, device or "cpu"), flush=True)
    code = asyncio.run(launch(argv, args.nprocs, args.registry, on_line=on_line, device=device))
    if args.json:
        print(json.dumps(rows, indent=2))
    return code


def header(world_size: int, op: str, dtype: str, device: str = "cpu") -> str:
    return (
        f"# dsml bench: world_size={world_size} op={op} dtype={dtype} device={device}\n"
        f"# {'bytes':>12} {'algorithm':>12} {'time(us)':>12} {'algbw(GB/s)':>12} "
        f"{'busbw(GB/s)':>12}"
    )


def format_row(row: dict[str, Any]) -> str:
    name = row["algorithm"]
    if name == "auto" and row.get("resolved"):
        name = f"auto({row['resolved']})"
    return (
        f"  {row['bytes']:>12} {name:>12} {row['median_s'] * 1e6:>12.1f} "
        f"{row['algbw_GBps']:>12.3f} {row['busbw_GBps']:>12.3f}"
    )


def format_table(rows: list[dict[str, Any]], op: str = "sum", dtype: str = "float32") -> str:
    size = rows[0]["world_size"] if rows else 0
    return "\n".join([header(size, op, dtype), *(format_row(r) for r in rows)])
