"""One rank of the Gloo side of benchmarks/allreduce_vs_gloo.py (run under `dsml run`).

Times torch.distributed all_reduce (Gloo backend; CPU tensors, or CUDA tensors when the
optional third argument is "cuda") exactly as `dsml bench` times dsml: warm-up calls, then
timed calls each preceded by a barrier; a call's time is the slowest rank's; the median is
reported. Rank 0 prints one JSON row per size.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from dsml.cli.bench_worker import iterations, row


def main() -> None:
    sizes = [int(s) for s in sys.argv[1].split(",")]
    port = sys.argv[2]
    on_gpu = len(sys.argv) > 3 and sys.argv[3] == "cuda"
    device = torch.device("cpu")
    if on_gpu:  # rank i on GPU i modulo the GPU count, as `dsml run --device cuda` does
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    for nbytes in sizes:
        x = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        iters = iterations(nbytes)
        for _ in range(max(2, iters // 5)):
            dist.all_reduce(x)
        times = torch.empty(iters, dtype=torch.float64)
        for i in range(iters):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            if on_gpu:
                torch.cuda.synchronize()  # dsml's cupy all_reduce returns with the data there
            times[i] = time.perf_counter() - start
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        if rank == 0:
            result = row(nbytes, world_size, "gloo", "sum", times.numpy(), "gloo")
            result["device"] = str(device)
            print("GLOO_ROW " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
