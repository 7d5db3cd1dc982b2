"""Hugging Face accelerate on the dsml backend, on CPU, as docs/torch.md says to run it:
create the process group first, then `Accelerator(cpu=True)`, which takes it as it finds
it. A model that accelerate prepares (DDP over dsml) trains STEPS steps and must end with
the reference's parameters; accelerate's own reduce and gather run on dsml too."""

import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from torch_frameworks_model import (
    BATCH,
    LR,
    STEPS,
    data,
    largest_difference,
    model,
    reference,
)

dist.init_process_group("dsml")  # the recipe's one line, before accelerate's state

from accelerate import Accelerator  # noqa: E402

accelerator = Accelerator(cpu=True)
rank, world = dist.get_rank(), dist.get_world_size()
assert dist.get_backend() == "dsml", dist.get_backend()
assert accelerator.distributed_type.value == "MULTI_CPU", accelerator.distributed_type
assert (accelerator.num_processes, accelerator.process_index) == (world, rank)

total = accelerator.reduce(torch.tensor([float(rank + 1)]), "sum")
assert total.item() == world * (world + 1) / 2, total
gathered = accelerator.gather(torch.tensor([rank]))
assert gathered.tolist() == list(range(world)), gathered

start = model()
net = model()
optimizer = torch.optim.SGD(net.parameters(), lr=LR)
loader = DataLoader(TensorDataset(*data(world)), batch_size=BATCH)
net, optimizer, loader = accelerator.prepare(net, optimizer, loader)
steps = 0
for x, y in loader:
    optimizer.zero_grad()
    accelerator.backward(torch.nn.functional.mse_loss(net(x), y))
    optimizer.step()
    steps += 1
assert steps == STEPS, steps
diff = largest_difference(accelerator.unwrap_model(net), reference(start, world))
assert diff < 1e-9, diff
accelerator.wait_for_everyone()
accelerator.end_training()  # destroys the process group
os.write(1, f"rank {rank} ok (largest difference from the reference {diff:.2g})\n".encode())
