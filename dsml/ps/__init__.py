"""Parameter servers: sharded named parameters, push/pull, BSP, SSP and async (ps layer).

Above the communicator: built on its point-to-point `send`/`recv`, nothing below imports
it. Some ranks serve shards of the parameters (keys cut by size across servers), the
others push gradients and pull parameters; the servers apply an optimizer.

    async with dsml.ps.open_ps(comm, model_params, servers=2, consistency="bsp",
                               optimizer=dsml.ps.SGD(0.1)) as ps:
        if ps.is_server:
            await ps.serve()
        else:
            for step in range(steps):
                grads = compute(params)
                for key, g in grads.items():
                    ps.push(key, g)
                await asyncio.gather(*(ps.pull(key, params[key]) for key in params))
            await ps.finish(pull=params)

Pushes can travel compressed (`PSConfig(push_compression="bf16" | "fp16" | "topk:R")`);
`PSConfig(replicas=1)` keeps a backup of each shard on the next server, which takes the
shard over when its server is lost (`dsml.ps.replica`).
See docs/train.md for the consistency models and what happens when a rank is lost.
"""

from .client import PSHandle
from .errors import PSError, ServerLostError
from .layout import KeySpec, Layout, Piece, shard
from .node import ParameterServers, PSConfig, open_ps
from .optim import SGD, Adam, Momentum, Optimizer
from .push_codec import CastPush, PlainPush, PushCodec, TopKPush, push_codec_from
from .shard_state import CONSISTENCY, ShardState

__all__ = [
    "CONSISTENCY",
    "SGD",
    "Adam",
    "CastPush",
    "KeySpec",
    "Layout",
    "Momentum",
    "Optimizer",
    "PSConfig",
    "PSError",
    "PSHandle",
    "ParameterServers",
    "Piece",
    "PlainPush",
    "PushCodec",
    "ServerLostError",
    "ShardState",
    "TopKPush",
    "open_ps",
    "push_codec_from",
    "shard",
]
