"""A rank of tests/test_security.py: publish who it is, wait for the attacker, reduce.

Each rank writes DIR/rank-R.json (member id, peer address, epoch), waits for DIR/go (the
attacker is connected and sending), runs CALLS all_reduce(algorithm="naive") and writes
DIR/result-R.json with every result and how many connections its endpoint refused.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import dsml
from dsml.transport import zap

CALLS = 15


async def main(folder: Path) -> None:
    async with dsml.init() as comm:
        me = {
            "id": comm.member_id,
            "address": comm.address,
            "epoch": comm.epoch,
            "registry": os.environ["DSML_REGISTRY"],
        }
        tmp = folder / f".rank-{comm.rank}"
        tmp.write_text(json.dumps(me))
        tmp.replace(folder / f"rank-{comm.rank}.json")  # whole, or not there
        deadline = time.monotonic() + 60
        while not (folder / "go").exists() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        await comm.barrier()
        results = []
        for _ in range(CALLS):
            x = np.full(4, comm.rank + 1.0)
            await comm.all_reduce(x, algorithm="naive")
            results.append(x.tolist())
        out = {"results": results, "refused": zap.refused(), "stats": comm.statistics()}
        tmp = folder / f".result-{comm.rank}"
        tmp.write_text(json.dumps(out, default=str))
        tmp.replace(folder / f"result-{comm.rank}.json")
        await comm.barrier()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
