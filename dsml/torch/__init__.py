"""torch.distributed backend "dsml" (adapter layer; the only part of dsml that imports torch).

    import dsml.torch                     # registers the backend
    import torch.distributed as dist

    dist.init_process_group("dsml")       # under torchrun or `dsml run`
    model = torch.nn.parallel.DistributedDataParallel(model)   # unchanged

Every torch.distributed collective runs on a dsml communicator (see `ProcessGroupDsml`),
so a lost peer raises within dsml's detection time instead of hanging: a
`torch.distributed.DistBackendError` chained to dsml's typed error (`PeerLostError`, ...)
from Python-level calls; from DDP's backward, the RuntimeError torch's C++ reducer makes
of it, whose message carries dsml's and for which `cause_of(exc)` returns the typed error.
See docs/torch.md.
"""

from __future__ import annotations

import torch.distributed as dist

from .process_group import ProcessGroupDsml
from .rendezvous import create_backend
from .work import DsmlWork, cause_of

__all__ = ["BACKEND", "DsmlWork", "ProcessGroupDsml", "cause_of", "create_backend"]

BACKEND = "dsml"

if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, create_backend, devices=["cpu", "cuda"])
