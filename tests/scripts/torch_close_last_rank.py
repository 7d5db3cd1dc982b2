"""One group, then destroy_process_group, where the other ranks are slow to wait in the
closing meeting (a probe): each says it closed, then waits a second before it waits for
the others. Rank 0 serves torch's store under `dsml run`; when it left the meeting at
once and its process ended, their wait met a closed server and torch printed a broken
pipe with its C++ stack. Rank 0 now leaves last."""

import datetime
import os
import time

import torch
import torch.distributed as dist

import dsml.torch.process_group as process_group

_meet = process_group.meet_at_close


def slow_meet(store: dist.Store, key: str, rank: int, size: int) -> None:
    if rank != 0:
        store.set(f"{key}{rank}", b"1")  # rank 0 sees every rank closed now ...
        time.sleep(1.0)  # ... while this one has yet to wait in the store
    _meet(store, key, rank, size)


process_group.meet_at_close = slow_meet
dist.init_process_group("dsml", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
x = torch.ones(2)
dist.all_reduce(x)
assert x.tolist() == [float(dist.get_world_size())] * 2, x
dist.destroy_process_group()
os.write(1, f"rank {rank} ok\n".encode())
