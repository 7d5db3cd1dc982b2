"""torch.distributed misuse on backend "dsml" (3 ranks, started by `dsml run -n 3`): every
rank gets an error within seconds, never a hang or a silent wrong answer; valid uneven
all-to-all works. Prints "ok" on every rank that saw what it should."""

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import dsml.torch  # noqa: F401 (registers the backend)

dist.init_process_group("dsml", timeout=timedelta(seconds=30))
rank, size = dist.get_rank(), dist.get_world_size()
assert size == 3


def fails_fast(what, call):
    start = time.monotonic()
    try:
        call()
    except (dist.DistBackendError, ValueError, RuntimeError) as exc:
        took = time.monotonic() - start
        assert took < 10, f"{what}: failed only after {took:.1f} s"
        return str(exc)
    raise AssertionError(f"{what}: no error on rank {rank}")


# valid uneven all_to_all_single, where one rank's splits happen to be equal (it hung)
s = [[2, 2, 2], [2, 1, 3], [2, 3, 1]]
inp = torch.arange(sum(s[rank]), dtype=torch.float32) + 100 * rank
out = torch.zeros(sum(s[j][rank] for j in range(size)))
dist.all_to_all_single(out, inp, [s[j][rank] for j in range(size)], s[rank])
want = []
for j in range(size):
    start = sum(s[j][:rank])
    want.append(torch.arange(sum(s[j]), dtype=torch.float32)[start : start + s[j][rank]] + 100 * j)
assert torch.equal(out, torch.cat(want)), (out, want)

# all_gather: output list too short on rank 0 only; inputs of different sizes
outs = [torch.zeros(2) for _ in range(size - 1 if rank == 0 else size)]
fails_fast("short output list", lambda: dist.all_gather(outs, torch.ones(2)))
outs = [torch.zeros(2) for _ in range(size)]
fails_fast("unequal inputs", lambda: dist.all_gather(outs, torch.ones(2 + (rank == 1))))
out = torch.zeros(3 * size, dtype=torch.int32)
fails_fast("dtype", lambda: dist.all_gather_into_tensor(out, torch.ones(3)))
# reduce_scatter_tensor with a wrong output size on rank 1 only
small = torch.zeros(2 if rank == 1 else 3)
fails_fast("reduce_scatter size", lambda: dist.reduce_scatter_tensor(small, torch.ones(9)))
# split sizes that do not add up, on rank 2 only
splits = [1, 1, 1] if rank != 2 else [1, 1, 5]
fails_fast(
    "split sizes",
    lambda: dist.all_to_all_single(torch.zeros(3), torch.ones(3), [1, 1, 1], splits),
)

# split sizes that add up but are too few, on rank 0 only (it hung the peers)
counts = [1, 1, 1] if rank != 0 else [3]
fails_fast(
    "split count",
    lambda: dist.all_to_all_single(torch.zeros(3), torch.ones(3), [1, 1, 1], counts),
)

# gather and scatter: a wrong size on one rank is an error on every rank (the root alone
# could tell, or the one rank: the others returned as if nothing were wrong)
gathered = [torch.zeros(2) for _ in range(size)] if rank == 0 else None
fails_fast("gather unequal", lambda: dist.gather(torch.ones(2 + (rank == 2)), gathered, dst=0))
short = [torch.zeros(2) for _ in range(size - 1)] if rank == 0 else None
fails_fast("gather short list", lambda: dist.gather(torch.ones(2), short, dst=0))
parts = [torch.full((2,), float(j)) for j in range(size)] if rank == 1 else None
mine = torch.zeros(3 if rank == 2 else 2)
fails_fast("scatter output size", lambda: dist.scatter(mine, parts, src=1))
dist.gather(torch.full((2,), float(rank)), gathered, dst=0)  # and valid ones still work
dist.scatter(mine := torch.zeros(2), parts, src=1)
assert torch.equal(mine, torch.full((2,), float(rank))), mine
if rank == 0:
    assert [g.tolist() for g in gathered] == [[float(j)] * 2 for j in range(size)], gathered

# allreduce_coalesced: one tensor of another shape on one rank (or the same total in other
# shapes) fails on every rank and changes none of the tensors (it reduced the others)
for shapes in ([(2,), (4,)], [(3,), (2,)]):
    mine = [torch.ones(s) for s in (shapes if rank == 1 else [(2,), (3,)])]
    fails_fast("coalesced shapes", lambda: dist.all_reduce_coalesced(mine))
    assert all(torch.equal(t, torch.ones_like(t)) for t in mine), mine
mine = [torch.ones(2), torch.full((2, 2), float(rank))]
dist.all_reduce_coalesced(mine)
assert torch.equal(mine[0], torch.full((2,), 3.0)), mine
assert torch.equal(mine[1], torch.full((2, 2), 3.0)), mine

# recv into another dtype: an error, the buffer untouched
if rank == 0:
    dist.send(torch.tensor([1.7, -2.5, 3e10], dtype=torch.float64), 1)
elif rank == 1:
    buf = torch.full((3,), 7, dtype=torch.int32)
    fails_fast("recv dtype", lambda: dist.recv(buf, 0))
    assert buf.tolist() == [7, 7, 7], buf

# after those, the group still works; the future is complete once wait() returns
for _ in range(50):
    t = torch.ones(4)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    assert work.get_future().done()
    assert torch.equal(work.get_future().value()[0], torch.full((4,), 3.0))

# a member leaves: later calls refuse instead of running in a smaller, renumbered group
dist.barrier()
if rank == 2:
    print("ok", flush=True)
    os._exit(0)
time.sleep(1.0)
fails_fast("first call after the loss", lambda: dist.all_reduce(torch.ones(2)))
message = fails_fast("later call", lambda: dist.all_reduce(torch.ones(2)))
assert "keep their size" in message or "re-create" in message, message
print("ok", flush=True)
os._exit(0)
