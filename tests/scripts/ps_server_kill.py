"""A rank of a parameter-server job whose server the test kills with SIGKILL (fault tests).

    DSML_REGISTRY=... DSML_WORLD_SIZE=4 DSML_RANK=R python tests/scripts/ps_server_kill.py

Ranks 0-2 are workers, rank 3 the server (`--consistency`, SGD). Each worker pushes and
pulls in a loop; every step it prints one JSON line. A call that fails ends its loop; the
worker then makes one more call to check that later calls fail at once with the same type,
prints what it saw and exits 0. The server prints `serving` and serves until it is killed.

Events (one JSON object per line, flushed):
  serving  {rank}
  step     {worker, step}
  failed   {worker, step, type, server, later, count}   count: errors the loop caught (1)
  finished {worker, step}                               (the server was never lost)
"""

from __future__ import annotations

import argparse
import asyncio
import json

import numpy as np

import dsml
import dsml.ps


def say(**event: object) -> None:
    print(json.dumps(event), flush=True)


async def work(node: dsml.ps.ParameterServers, params: dict[str, np.ndarray], steps: int) -> None:
    errors: list[BaseException] = []
    step = 0
    while step < steps:
        try:
            node.push("w", np.full_like(params["w"], 1e-3))
            await node.pull("w", params["w"])
        except dsml.DsmlError as exc:
            errors.append(exc)
            break
        step += 1
        say(event="step", worker=node.index, step=step)
    if not errors:
        say(event="finished", worker=node.index, step=step)
        await node.finish()
        return
    try:
        await node.pull("w", params["w"])
        later = "none"
    except dsml.DsmlError as exc:
        later = type(exc).__name__
    first = errors[0]
    server = getattr(first, "server", None)
    say(
        event="failed",
        worker=node.index,
        step=step,
        type=type(first).__name__,
        server=server,
        later=later,
        count=len(errors),
    )


async def main(args: argparse.Namespace) -> None:
    params = {"w": np.zeros((256, 64), np.float32), "b": np.zeros(64, np.float32)}
    config = dsml.ps.PSConfig(servers=1, consistency=args.consistency, timeout=60.0)
    async with dsml.init() as comm:
        node = await dsml.ps.open_ps(comm, params, config)
        try:
            if node.is_server:
                say(event="serving", rank=comm.rank)
                await node.serve()
            else:
                await work(node, params, args.steps)
        finally:
            await node.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--consistency", default="async")
    parser.add_argument("--steps", type=int, default=1_000_000)
    asyncio.run(main(parser.parse_args()))
