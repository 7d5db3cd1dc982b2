"""The model, data and reference of the framework tests (accelerate, Lightning on dsml).

A linear model trained with SGD on a mean-squared loss, in float64. With data parallelism
(DDP averages the ranks' gradients) and shards that are equal in size, a step over every
rank's batch is one step over their union. Step i's batches together hold samples
`order[i*batch*world : (i+1)*batch*world]`: accelerate's shards give rank r batch
i*world + r of the data in order; Lightning's DistributedSampler gives rank r every
world-th sample of a permutation seeded with 0 (it shuffles training data). The reference
takes those steps in this process, on the whole data, without torch.distributed.
"""

from __future__ import annotations

import copy

import torch

BATCH, STEPS, LR = 4, 6, 0.1


def data(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets for STEPS steps of BATCH samples on each of `world` ranks."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH * world * STEPS, 3, dtype=torch.float64, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64) + 0.25
    return x, y


def shuffled(world: int) -> torch.Tensor:
    """The order of torch's DistributedSampler(shuffle=True, seed=0) in epoch 0."""
    return torch.randperm(BATCH * world * STEPS, generator=torch.Generator().manual_seed(0))


def model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1).double()


def reference(
    start: torch.nn.Module, world: int, order: torch.Tensor | None = None
) -> torch.nn.Module:
    """`start` trained in this process as the ranks train it together, on the samples in
    `order` (all of them in turn when None)."""
    trained = copy.deepcopy(start)
    optimizer = torch.optim.SGD(trained.parameters(), lr=LR)
    x, y = data(world)
    if order is None:
        order = torch.arange(len(x))
    for step in range(STEPS):
        part = order[step * BATCH * world : (step + 1) * BATCH * world]
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(trained(x[part]), y[part]).backward()
        optimizer.step()
    return trained


def largest_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max(float((p - q).abs().max()) for p, q in pairs)
