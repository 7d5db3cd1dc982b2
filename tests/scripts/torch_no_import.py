"""init_process_group("dsml") without `import dsml.torch`: torch's autoload registers it."""

import sys

import torch
import torch.distributed as dist

dist.init_process_group("dsml")  # no import of dsml here
t = torch.full((3,), float(dist.get_rank() + 1))
dist.all_reduce(t)
expected = sum(range(1, dist.get_world_size() + 1))
print("ok" if torch.equal(t, torch.full((3,), float(expected))) else f"wrong {t}")
print("imported by torch:", "dsml.torch" in sys.modules, file=sys.stderr)
dist.destroy_process_group()
