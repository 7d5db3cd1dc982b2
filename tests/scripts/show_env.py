"""Print the variables dsml run sets, then join the group to prove init() needs no args."""

import asyncio
import json
import os

import dsml

NAMES = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "OMP_NUM_THREADS",
    "DSML_REGISTRY",
    "DSML_WORLD_SIZE",
    "DSML_RANK",
    "DSML_LOCAL_RANK",
    "DSML_DEVICE",
]


async def main() -> None:
    async with dsml.init() as comm:
        values = {name: os.environ.get(name) for name in NAMES}
        values["comm_rank"] = comm.rank
        values["comm_world_size"] = comm.world_size
        values["comm_device"] = comm.device
        print(json.dumps(values), flush=True)


asyncio.run(main())
