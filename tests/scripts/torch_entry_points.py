"""Every ProcessGroup entry point torch has, called as torch's overloads allow, on "dsml"
and on "gloo" side by side: same results. Prints "ok" on each rank.

Run with the variables torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

import dsml.torch  # noqa: F401 (registers "dsml")


def results(pg: dist.ProcessGroup, rank: int, world: int) -> dict[str, object]:
    """What each call form gives on this rank."""
    out: dict[str, object] = {}
    t = torch.full((4,), float(rank + 1))
    pg.allreduce([t]).wait()  # options omitted
    out["allreduce list"] = t.clone()
    t = torch.full((4,), float(rank + 1))
    pg.allreduce(t, dist.ReduceOp.MAX).wait()  # tensor and op
    out["allreduce tensor op"] = t.clone()
    t = torch.full((3,), float(rank))
    pg.broadcast([t]).wait()
    out["broadcast list"] = t.clone()
    t = torch.full((3,), float(rank))
    pg.broadcast(t, world - 1).wait()
    out["broadcast tensor root"] = t.clone()
    t = torch.full((2,), float(rank + 2))
    pg.reduce(t, 0, dist.ReduceOp.PRODUCT).wait()
    out["reduce tensor root op"] = t.clone() if rank == 0 else None
    outs = [torch.zeros(2) for _ in range(world)]
    pg.allgather(outs, torch.full((2,), float(rank))).wait()
    out["allgather tensor"] = torch.stack(outs)
    inputs = [torch.full((2,), float(rank)), torch.arange(3.0) + rank, torch.zeros(0)]
    lists = [[torch.zeros_like(x) for x in inputs] for _ in range(world)]
    pg.allgather_coalesced(lists, inputs).wait()
    out["allgather_coalesced"] = [torch.cat(per_rank) for per_rank in lists]
    a, b = torch.full((2,), float(rank)), torch.full((3,), float(rank * 10))
    pg.allreduce_coalesced([a, b]).wait()
    out["allreduce_coalesced"] = torch.cat([a, b])
    parts = [torch.full((2,), float(r)) for r in range(world)] if rank == 0 else []
    mine = torch.zeros(2)
    pg.scatter(mine, parts, 0).wait()
    out["scatter tensor"] = mine
    gathered = [torch.zeros(2) for _ in range(world)] if rank == 0 else []
    pg.gather(gathered, torch.full((2,), float(rank)), 0).wait()
    out["gather tensor"] = torch.stack(gathered) if rank == 0 else None
    got = torch.zeros(2)
    pg.reduce_scatter(got, [torch.full((2,), float(r + rank)) for r in range(world)]).wait()
    out["reduce_scatter tensor"] = got
    pg.barrier().wait()
    pg.barrier(timedelta(seconds=30)).wait()
    return out


def any_source(pg: dist.ProcessGroup, rank: int, world: int, per_rank: int = 8) -> list[int]:
    """Rank 0 receives from any source while every other rank sends `per_rank` messages at
    once; each source's messages arrive whole and in order. The sources, in order."""
    if rank != 0:
        works = [pg.send([torch.full((2,), float(rank * 100 + i))], 0, 7) for i in range(per_rank)]
        for work in works:
            work.wait()
        return []
    sources, seen = [], dict.fromkeys(range(1, world), 0)
    for _ in range(per_rank * (world - 1)):
        t = torch.zeros(2)
        work = pg.recv_anysource([t], 7)
        work.wait()
        src = work._source_rank()
        assert torch.equal(t, torch.full((2,), float(src * 100 + seen[src]))), (t, src, seen)
        seen[src] += 1
        sources.append(src)
    assert all(n == per_rank for n in seen.values()), seen
    return sorted(sources)


def sparse(pg: dist.ProcessGroup, rank: int, world: int) -> torch.Tensor:
    t = torch.sparse_coo_tensor(
        [[rank, rank + 1]], [1.0, float(rank)], (world + 1,), check_invariants=True
    )
    pg.allreduce([t]).wait()
    return t.to_dense()


def main() -> None:
    dist.init_process_group("dsml", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    ours = dist.group.WORLD
    assert ours._get_backend(torch.device("cpu")) is not None
    mine, theirs = results(ours, rank, world), results(gloo, rank, world)
    for key, value in mine.items():
        assert str(value) == str(theirs[key]), (key, value, theirs[key])
    assert any_source(ours, rank, world) == any_source(gloo, rank, world)
    assert torch.equal(sparse(ours, rank, world), sparse(gloo, rank, world))
    ours.monitored_barrier(timedelta(seconds=30))
    ours.monitored_barrier(timedelta(seconds=30), wait_all_ranks=True)
    opts = c10d.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    t = torch.full((2,), float(rank))
    ours.allreduce([t], opts).wait()
    assert torch.equal(t, torch.zeros(2)), t
    dist.destroy_process_group()
    print("ok", os.environ.get("RANK"))


if __name__ == "__main__":
    main()
