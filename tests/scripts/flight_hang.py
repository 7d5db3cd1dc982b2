"""A 4-rank hang for the flight recorder: rank 2 does SCENARIO instead of all_reduce #3.

- skip: it skips the call and waits for the group to change (the others leave);
- busy: its event loop is blocked by a long synchronous computation;
- recv: it waits in recv from rank 0 (tag 0), which never sends.

The others' all_reduce #3 times out (CALL_TIMEOUT s); rank 0 then sends SIGUSR1 to the
ranks the timeout named (their pids came in collective #1), as an operator would.
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
                compute(3 * timeout)
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
            if comm.rank == 0:
                for rank in getattr(exc, "missing", []):
                    os.kill(int(pids[rank]), signal.SIGUSR1)


asyncio.run(main())
