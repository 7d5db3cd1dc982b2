"""DDP on backend "dsml" and on "gloo", side by side in the same processes, from the same
seed for 20 steps; rank 0 prints the largest parameter difference as JSON. Arguments:
steps (20), then "cuda" to train on GPU `LOCAL_RANK % count` (gloo takes CUDA tensors too)."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import dsml.torch  # noqa: F401 (registers the backend)

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 20
DEVICE = torch.device("cpu")
if sys.argv[2:] == ["cuda"]:
    DEVICE = torch.device(
        "cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    )
    torch.cuda.set_device(DEVICE)

dist.init_process_group("dsml")
rank, size = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(list(range(size)), backend="gloo")


def model() -> torch.nn.Module:
    torch.manual_seed(1234 + rank)  # different on every rank: DDP's first broadcast aligns them
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def train(group) -> list[torch.Tensor]:
    ddp = DDP(model().to(DEVICE), process_group=group, bucket_cap_mb=0.01)  # several buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn(16, 64, generator=data)
        y = torch.randint(0, 10, (16,), generator=data)
        x, y = x.to(DEVICE), y.to(DEVICE)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return [p.detach().cpu().clone() for p in ddp.parameters()]


with_dsml, with_gloo = train(None), train(gloo)
diff = max(float((a - b).abs().max()) for a, b in zip(with_dsml, with_gloo, strict=True))
moved = sum(float(p.abs().sum()) for p in with_dsml)
# every rank must hold the same parameters
gathered = [torch.zeros(1) for _ in range(size)]
dist.all_gather(gathered, torch.tensor([moved]), group=gloo)
if rank == 0:
    print(json.dumps({"max_diff": diff, "ranks_agree": len({float(g) for g in gathered}) == 1}))
dist.destroy_process_group()
