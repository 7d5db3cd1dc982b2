"""torch.distributed backend "dsml" (adapter layer; the only part of dsml that imports torch).

    import dsml.torch                     # registers the backend
    import torch.distributed as dist

    dist.init_process_group("dsml")       # under torchrun or `dsml run`
    model = torch.nn.parallel.DistributedDataParallel(model)   # unchanged

Every torch.distributed collective runs on a dsml communicator (see `ProcessGroupDsml`),
so a lost peer raises `torch.distributed.DistBackendError`, chained to dsml's typed error
(`PeerLostError`, ...), within dsml's detection time instead of hanging. See docs/torch.md.
"""

from __future__ import annotations

import torch.distributed as dist

from .process_group import ProcessGroupDsml, create_backend
from .work import DsmlWork

__all__ = ["BACKEND", "DsmlWork", "ProcessGroupDsml", "create_backend"]

BACKEND = "dsml"

if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, create_backend, devices=["cpu", "cuda"])
