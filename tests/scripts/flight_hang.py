"""A 4-rank hang for the flight recorder: rank 2 does SCENARIO instead of all_reduce #3.

- skip: it skips the call and waits for the group to change (the others leave);
- busy: its event loop is blocked by a long synchronous computation;
- recv: it waits in recv from rank 0 (tag 0), which never sends.

The others' all_reduce #3 times out (CALL_TIMEOUT s); each then sends SIGUSR1 to the ranks
its timeout named (their pids came in collective #1), as an operator would. Each, not only
rank 0: the first to time out aborts the call at the others, whose error names nobody.
"""

import asyncio
import os
import signal
import time

import numpy as np

import dsml
from dsml import DsmlError

STUCK = 2


def compute(seconds: float) -> None:
    time.sleep(seconds)


async def main() -> None:
    scenario = os.environ["SCENARIO"]
    timeout = float(os.environ.get("CALL_TIMEOUT", "3"))
    async with dsml.init(timeout=timeout) as comm:
        pids = await comm.all_gather(np.array([os.getpid()]))  # collective #1
        x = np.ones(1024)
        await comm.all_reduce(x)  # collective #2
        if comm.rank == STUCK:
            if scenario == "skip":
                await comm.wait_view_change(timeout=30)
            elif scenario == "busy":
                compute(2 * timeout + 1)  # past the others' timeout and SIGUSR1
            else:
                try:
                    await comm.recv(0, tag=0, timeout=30)
                except DsmlError as exc:
                    print(f"rank {comm.rank}: recv ended: {type(exc).__name__}")
            return
        try:
            await comm.all_reduce(x)  # collective #3: rank 2 is not there
        except DsmlError as exc:
            print(f"rank {comm.rank}: {type(exc).__name__}")
            for rank in getattr(exc, "missing", None) or []:
                os.kill(int(pids[rank]), signal.SIGUSR1)


asyncio.run(main())
