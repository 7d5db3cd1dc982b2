"""work.wait(timeout) running out on rank 0 while rank 1 is late: rank 0's call is
cancelled with its tensor intact, rank 1's matching call fails, and the group goes on.
Prints "ok" on each rank."""

import datetime
import os
import time

import torch
import torch.distributed as dist

import dsml.torch  # noqa: F401  (registers the backend)

dist.init_process_group("dsml", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
x = torch.full((1000,), float(rank + 1))
if rank == 0:
    work = dist.all_reduce(x, async_op=True)
    started = time.monotonic()
    error = ""
    try:
        work.wait(timeout=datetime.timedelta(seconds=1))
    except dist.DistBackendError as exc:
        error = str(exc)
    assert "Timed out waiting 1000ms for it to finish, so it was cancelled" in error, error
    assert time.monotonic() - started < 5
    assert torch.equal(x, torch.full((1000,), 1.0)), x  # intact, and stays so
    time.sleep(2.5)
    assert torch.equal(x, torch.full((1000,), 1.0)), x
else:
    time.sleep(2)  # late
    error = ""
    try:
        dist.all_reduce(x)  # fails: its peer cancelled the call
    except dist.DistBackendError as exc:
        error = str(exc)
    assert "cancel" in error.lower(), error
    assert torch.equal(x, torch.full((1000,), 2.0)), x
y = torch.full((4,), float(rank + 1))
dist.all_reduce(y)  # the group goes on
assert torch.equal(y, torch.full((4,), 3.0)), y
dist.destroy_process_group()
os.write(1, b"ok\n")  # one write: ranks share stdout under torchrun
