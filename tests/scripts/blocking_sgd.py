"""A synchronous data-parallel training loop on dsml.blocking (started by `dsml run`).

Linear regression by gradient descent: each rank holds a shard of the data, averages its
gradient with the others every step, and prints the final weights as JSON.
"""

import json
import sys

import numpy as np

import dsml.blocking

STEPS, FEATURES, ROWS_PER_RANK = int(sys.argv[1]), 4, 32

with dsml.blocking.init() as comm:
    rng = np.random.default_rng(0)  # every rank draws the same data, then takes its shard
    x_all = rng.normal(size=(comm.world_size * ROWS_PER_RANK, FEATURES))
    y_all = x_all @ np.arange(1.0, FEATURES + 1)
    mine = slice(comm.rank * ROWS_PER_RANK, (comm.rank + 1) * ROWS_PER_RANK)
    x, y = x_all[mine], y_all[mine]
    w = np.zeros(FEATURES)
    comm.broadcast(w, root=0)
    for _ in range(STEPS):
        grad = 2 * x.T @ (x @ w - y) / ROWS_PER_RANK
        comm.all_reduce(grad, "avg")  # blocks; in place
        w -= 0.05 * grad
    loss = comm.all_reduce(np.array([np.mean((x @ w - y) ** 2)]), "avg")
    print(json.dumps({"rank": comm.rank, "w": w.tolist(), "loss": float(loss[0])}))
