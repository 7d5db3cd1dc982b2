"""Lightning's CPU Trainer on the dsml backend: `DDPStrategy(process_group_backend="dsml")`
under a launcher that starts the ranks (Lightning then starts none). A LightningModule
trains STEPS steps (on data Lightning shuffles and shards) and must end with the
reference's parameters on every rank."""

import os
import sys

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset
from torch_frameworks_model import (
    BATCH,
    LR,
    STEPS,
    data,
    largest_difference,
    model,
    reference,
    shuffled,
)


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = model()

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


world = int(os.environ["WORLD_SIZE"])
module = Regression()
start = model()
trainer = pl.Trainer(
    accelerator="cpu",
    devices=world,
    strategy=DDPStrategy(process_group_backend="dsml"),
    max_epochs=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(module, DataLoader(TensorDataset(*data(world)), batch_size=BATCH))
assert dist.get_backend() == "dsml", dist.get_backend()
assert trainer.global_step == STEPS, trainer.global_step
diff = largest_difference(module.net, reference(start, world, shuffled(world)))
assert diff < 1e-9, diff
rank = trainer.global_rank
dist.destroy_process_group()
os.write(1, f"rank {rank} ok (largest difference from the reference {diff:.2g})\n".encode())
sys.exit(0)
