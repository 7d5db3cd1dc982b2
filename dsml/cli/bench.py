"""`dsml bench`: all_reduce time and bandwidth, nccl-tests style (cli layer).

Runs N ranks on this machine (through the same launcher as `dsml run`) and prints, per size
and algorithm, the number of timed calls, the 10th/50th/90th percentiles of the time of one
all_reduce, the algorithm bandwidth (bytes / median time) and the bus bandwidth
(algbw x 2(P-1)/P, comparable across world sizes). For `auto` it names the algorithm auto
chose. Arrays are numpy, or cupy with `--device cuda` (rank i on GPU i modulo the GPU count).

The table (or with `--json`, only the JSON list) goes to stdout; everything else, the ranks'
own output and errors included, goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from ..collectives import ALL_REDUCE_ALGORITHMS, DTYPES, check_algorithm, check_op
from ..config import parse_size
from ..errors import ConfigError
from ..launch.job import launch
from ..launch.rank_setup import CPU_BIND
from .keys import add_curve_keys_option
from .run import check_device

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
        help=f"one of {', '.join(('auto', *ALL_REDUCE_ALGORITHMS))}; a comma-separated "
        "list of them; or all (default: auto)",
    )
    parser.add_argument(
        "--iters", type=int, default=0, help="timed calls per size (default: by size)"
    )
    add_curve_keys_option(parser, "CURVE keys for the registry and every rank, as dsml run's")
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu (numpy arrays) or cuda (cupy arrays, rank i on GPU i modulo the GPU count)",
    )
    parser.add_argument(
        "--gpu-reduce",
        default="host",
        choices=("host", "device"),
        help="with --device cuda: reduce in pinned host memory or with cupy kernels on the "
        "GPU (CommConfig.gpu_reduce; default: %(default)s)",
    )
    parser.add_argument("--registry", help="an existing registry (default: embedded)")
    parser.add_argument(
        "--cpu-bind",
        choices=CPU_BIND,
        default="auto",
        help="as for dsml run (default: %(default)s: bound only with more ranks than CPUs)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print a JSON list with one object per size and algorithm: bytes, algorithm, "
        "chosen (what auto ran), iterations, p10_s, p50_s, p90_s, algbw_GBps, busbw_GBps",
    )
    parser.set_defaults(handler=_main)


def _algorithms(text: str) -> list[str]:
    """The --algorithm list; ConfigError (listing the valid names) for an unknown one."""
    if text == "all":
        return ["auto", *ALL_REDUCE_ALGORITHMS]
    return [check_algorithm(name.strip()) for name in text.split(",")]


def _main(args: argparse.Namespace) -> int:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    itemsize = DTYPES[args.dtype].itemsize
    for size in sizes:
        if size < itemsize or size % itemsize:
            raise ConfigError(
                f"--sizes: {size} bytes is not a whole number of {args.dtype} elements "
                f"({itemsize} bytes each)"
            )
    if args.iters < 0:
        raise ConfigError("--iters must be at least 1 (or 0: chosen by size)")
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
        "--gpu-reduce",
        args.gpu_reduce,
    ]
    rows: list[dict[str, Any]] = []

    def on_line(rank: int, stream: str, line: str) -> None:
        if stream == "stdout" and line.startswith(ROW_PREFIX):
            rows.append(json.loads(line[len(ROW_PREFIX) :]))
            if not args.json:
                print(format_row(rows[-1]), flush=True)
        else:  # stdout holds only the table or the JSON list
            print(f"[rank {rank}] {line}", file=sys.stderr, flush=True)

    if not args.json:
        cuda = device is not None and device != "cpu"
        label = f"{device} gpu_reduce={args.gpu_reduce}" if cuda else (device or "cpu")
        print(header(args.nprocs, args.op, args.dtype, label), flush=True)
    code = asyncio.run(
        launch(
            argv,
            args.nprocs,
            args.registry,
            on_line=on_line,
            device=device,
            cpu_bind=args.cpu_bind,
            curve_keys=args.curve_keys,
        )
    )
    if args.json:  # also after a failure: the sizes measured until then
        print(json.dumps(rows, indent=2))
    if code != 0:
        print(f"dsml bench: the benchmark failed (exit code {code})", file=sys.stderr)
    return code


# "hierarchical(direct)" is the longest name a row shows: what ran, with what auto or
# hierarchical chose inside it
NAME_WIDTH = 20


def header(world_size: int, op: str, dtype: str, device: str = "cpu") -> str:
    return (
        f"# dsml bench: world_size={world_size} op={op} dtype={dtype} device={device}\n"
        f"# {'bytes':>12} {'algorithm':>{NAME_WIDTH}} {'iters':>6} {'p10(us)':>10} {'p50(us)':>10} "
        f"{'p90(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}"
    )


def format_row(row: dict[str, Any]) -> str:
    name = row["algorithm"]
    if row.get("chosen") and row["chosen"] != name:  # what auto chose; shm that fell back
        name = f"{name}({row['chosen']})"
    return (
        f"  {row['bytes']:>12} {name:>{NAME_WIDTH}} {row['iterations']:>6} "
        f"{row['p10_s'] * 1e6:>10.1f} {row['p50_s'] * 1e6:>10.1f} {row['p90_s'] * 1e6:>10.1f} "
        f"{row['algbw_GBps']:>12.3f} {row['busbw_GBps']:>12.3f}"
    )


def format_table(rows: list[dict[str, Any]], op: str = "sum", dtype: str = "float32") -> str:
    size = rows[0]["world_size"] if rows else 0
    return "\n".join([header(size, op, dtype), *(format_row(r) for r in rows)])
