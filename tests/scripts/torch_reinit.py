"""Three rounds of init_process_group("dsml") / collectives / destroy_process_group in one
process (a sweep, a test suite), each with a sub-group of ranks 0 and 2: every round must
form, reduce exactly, and name the sub-group's members by their global ranks."""

import datetime
import os

import torch
import torch.distributed as dist

import dsml.torch  # noqa: F401  (registers the backend)

for round_ in range(3):
    dist.init_process_group("dsml", timeout=datetime.timedelta(seconds=60))
    rank, size = dist.get_rank(), dist.get_world_size()
    x = torch.full((4,), float(rank + round_))
    dist.all_reduce(x)
    assert x.tolist() == [float(sum(range(size)) + size * round_)] * 4, x
    sub = dist.new_group([0, 2])
    if rank in (0, 2):
        backend = sub  # the backend object itself: a ProcessGroupDsml
        names = [m.name for m in backend.comm.view.members]
        assert names == ["torch rank 0", "torch rank 2"], names
        y = torch.ones(2)
        dist.all_reduce(y, group=sub)
        assert y.tolist() == [2.0, 2.0], y
    dist.destroy_process_group()
    os.write(1, f"round {round_} ok\n".encode())  # one write: ranks share stdout
