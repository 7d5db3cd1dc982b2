"""Nested split across processes, and a member killed while a nested call waits for it.

    python tests/scripts/nested_split.py --registry tcp://127.0.0.1:PORT --world-size 4

Every rank splits the group (`sub`: key -rank, so sub-rank s is rank 3 - s) and splits
`sub` by the parity of its sub-rank (`inner`), checks an all_reduce on `inner`, then
prints `ready`. Rank 3 (sub-rank 0, in `inner` with rank 1) then waits to be killed;
rank 1 has an all_reduce of `inner` in flight that needs it. The test kills rank 3 with
SIGKILL; the survivors print what each next call did:

  joined   {rank}
  exact    {rank, total, members}        the first nested all_reduce and all_gather
  ready    {rank}                        rank 1: its nested all_reduce is in flight
  outcome  {rank, step, type}            type: the error's class, or "ok"
  after    {rank, total, members}        a fresh split of a split in the survivors' view

One JSON object per line, flushed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Awaitable
from typing import Any

import numpy as np

import dsml

VICTIM, PARTNER = 3, 1


def say(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


async def outcome(rank: int, step: str, call: Awaitable[Any]) -> Any:
    try:
        result = await call
    except dsml.DsmlError as exc:
        say("outcome", rank=rank, step=step, type=type(exc).__name__, error=str(exc)[:300])
        return None
    say("outcome", rank=rank, step=step, type="ok")
    return result


async def nested_sum(comm: dsml.Communicator, split: Any) -> tuple[int, list[int]]:
    """All-reduce rank + 1 and all-gather the ranks over the nested group `split` gave."""
    x = np.full(1000, comm.rank + 1, dtype=np.int64)
    await split.all_reduce(x)
    members = (await split.all_gather(np.array([comm.rank], dtype=np.int64))).tolist()
    return int(x[0]), members


async def main(registry: str, world_size: int) -> None:
    async with dsml.init(registry, world_size=world_size, timeout=60) as comm:
        rank = comm.rank
        say("joined", rank=rank)
        sub = await comm.split(0, key=-rank)
        inner = await sub.split(sub.rank % 2)
        total, members = await nested_sum(comm, inner)
        say("exact", rank=rank, total=total, members=members)
        await comm.barrier()
        if rank == VICTIM:
            say("ready", rank=rank)
            await asyncio.Event().wait()  # until SIGKILL
        if rank == PARTNER:
            pending = inner.all_reduce(np.ones(1 << 16))
            say("ready", rank=rank)
            await outcome(rank, "nested call in flight", pending)
        else:
            say("ready", rank=rank)
        await comm.wait_view_change(timeout=30)  # the survivors' view is known
        await outcome(rank, "nested split", sub.split(0))
        await outcome(rank, "root call 1", comm.all_reduce(np.ones(2)))
        await outcome(rank, "root call 2", comm.all_reduce(np.ones(2)))
        fresh = await comm.split(0)
        total, members = await nested_sum(comm, await fresh.split(fresh.rank % 2))
        say("after", rank=comm.rank, total=total, members=members)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--registry", required=True)
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args()
    asyncio.run(main(args.registry, args.world_size))
