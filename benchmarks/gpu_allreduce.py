"""all_reduce of GPU arrays: dsml on cupy against dsml on numpy and Gloo on CUDA tensors.

    python benchmarks/gpu_allreduce.py --ranks 2,4 --sizes 64K,1M,16M,64M

For each world size (all ranks share the GPUs there are: rank i on GPU i modulo the count),
`dsml bench --device cuda` under both places of reduction (`--gpu-reduce host`, the
default, and `device`), one run of `dsml bench --device cpu`, and, when torch with CUDA is
installed, torch.distributed's Gloo backend on CUDA tensors, timed the same way (a call
ends when the result is back on the GPU). Prints busbw and the ratios cupy/numpy (the cost
of staging through host memory, default cupy path) and cupy/Gloo. Needs cupy and a GPU:
without them it says so and exits with status 2. Benchmarks are not tests.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, NoReturn

from allreduce_vs_gloo import HERE, free_port
from common import dsml, tagged_lines


def fail(message: str) -> NoReturn:
    print(f"gpu_allreduce: {message}", file=sys.stderr)
    sys.exit(2)


def gpu_count() -> int:
    """GPUs visible through cupy; exits with a clear message when there are none."""
    try:
        import cupy
    except ImportError:
        fail('cupy is not installed: pip install "dsml[gpu]"')
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # no driver
        fail(f"no usable CUDA GPU ({exc})")
    if count == 0:
        fail("no CUDA GPU is visible to this process")
    return count


def bench(n: int, sizes: str, device: str, gpu_reduce: str = "host") -> list[dict[str, Any]]:
    out = dsml(
        "bench",
        "-n",
        str(n),
        "--sizes",
        sizes,
        "--device",
        device,
        "--gpu-reduce",
        gpu_reduce,
        "--json",
    )
    return json.loads(out[out.index("[") :])  # type: ignore[no-any-return]


def gloo_cuda(n: int, sizes: list[int]) -> list[dict[str, Any]]:
    try:
        import torch
    except ImportError:
        print("# torch is not installed: Gloo side skipped", file=sys.stderr)
        return []
    if not torch.cuda.is_available():
        print("# torch has no CUDA: Gloo side skipped", file=sys.stderr)
        return []
    sizes_arg, port = ",".join(map(str, sizes)), str(free_port())
    worker = str(HERE / "gloo_worker.py")
    out = dsml("run", "-n", str(n), worker, sizes_arg, port, "cuda", env={"OMP_NUM_THREADS": "1"})
    return [json.loads(line) for line in tagged_lines(out, "GLOO_ROW")]


def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str:
    if a is None or b is None:
        return f"{'-':>8}"
    return f"{a['busbw_GBps'] / b['busbw_GBps']:>7.2f}x"


def busbw(r: dict[str, Any] | None) -> str:
    return f"{r['busbw_GBps']:>8.3f}" if r else f"{'-':>8}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4", help="world sizes (default: 2,4)")
    parser.add_argument("--sizes", default="64K,1M,16M,64M")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    gpus = gpu_count()
    results = []
    for n in (int(r) for r in args.ranks.split(",")):
        cupy_rows = bench(n, args.sizes, "cuda")
        device_rows = bench(n, args.sizes, "cuda", "device")
        numpy_rows = bench(n, args.sizes, "cpu")
        gloo_rows = gloo_cuda(n, sorted({r["bytes"] for r in cupy_rows}))
        results.append((n, cupy_rows, device_rows, numpy_rows, gloo_rows))
    if args.json:
        keys = ("ranks", "cupy", "cupy_device", "numpy", "gloo_cuda")
        print(json.dumps([dict(zip(keys, r, strict=True)) for r in results], indent=2))
        return
    print(f"# float32 sum, {gpus} GPU(s); busbw in GB/s; ratios of busbw")
    print("# cupy: gpu_reduce=host (the default); on-gpu: gpu_reduce=device")
    print(
        f"# {'ranks':>5} {'bytes':>10} {'cupy':>8} {'on-gpu':>8} {'numpy':>8} {'gloo':>8} "
        f"{'cupy/np':>8} {'cupy/gloo':>9}"
    )
    for n, cupy_rows, device_rows, numpy_rows, gloo_rows in results:
        by_size = {r["bytes"]: r for r in numpy_rows}
        on_gpu = {r["bytes"]: r for r in device_rows}
        gloo = {r["bytes"]: r for r in gloo_rows}
        for r in cupy_rows:
            g, c, d = gloo.get(r["bytes"]), by_size.get(r["bytes"]), on_gpu.get(r["bytes"])
            print(
                f"  {n:>5} {r['bytes']:>10} {busbw(r)} {busbw(d)} {busbw(c)} {busbw(g)} "
                f"{ratio(r, c)} {ratio(r, g):>9}"
            )


if __name__ == "__main__":
    main()
