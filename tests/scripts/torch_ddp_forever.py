"""DDP on backend "dsml" until a peer is lost; prints each step, then how training ended."""

import json
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import dsml
import dsml.torch

dist.init_process_group("dsml")
rank = dist.get_rank()
ddp = DDP(torch.nn.Linear(32, 4))
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
step = 0
try:
    while True:
        opt.zero_grad()
        ddp(torch.randn(8, 32)).sum().backward()
        opt.step()
        step += 1
        if step in (1, 2, 3):
            print(f"step {step}", flush=True)
except Exception as exc:
    cause = dsml.torch.cause_of(exc)  # torch's C++ reducer drops the exception chain
    print(
        json.dumps(
            {
                "raised_at": time.time(),
                "error": type(exc).__name__,
                "dsml_error": type(cause).__name__ if isinstance(cause, dsml.DsmlError) else None,
                "message": str(exc)[:300],
            }
        ),
        flush=True,
    )
