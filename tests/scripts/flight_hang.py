"""A 4-rank hang for the flight recorder: rank 2 does SCENARIO instead of all_reduce #3.

- skip: it skips the call and waits for the group to change (the others leave);
- busy: its event loop is blocked by a long synchronous computation (until its flight
  record is written, at most 30 s);
- recv: it waits in recv from rank 0 (tag 0), which never sends.

The others' all_reduce #3 times out (CALL_TIMEOUT s); rank 0 then sends SIGUSR1 to the ranks
its timeout named (their pids came in collective #1), as an operator would; rank 2 when
its call was aborted by a peer's timeout first (that error names no rank).
"""

import asyncio
import os
import signal
import time
from pathlib import Path

import numpy as np

import dsml
from dsml import DsmlError

STUCK = 2


def compute(done: Path, seconds: float) -> None:
    """A long computation that holds the loop: until `done` exists (this rank's flight
    record, written from SIGUSR1 meanwhile), at most `seconds`."""
    end = time.monotonic() + seconds
    while not done.exists() and time.monotonic() < end:
        time.sleep(0.05)


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
                mine = f"rank{comm.rank}-pid{os.getpid()}.json"
                compute(Path(os.environ["DSML_FLIGHT_DIR"]) / mine, 30)
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
            if comm.rank == 0:  # one operator, one signal: a later one would see rank 2 idle
                for rank in getattr(exc, "missing", None) or [STUCK]:
                    os.kill(int(pids[rank]), signal.SIGUSR1)


asyncio.run(main())
