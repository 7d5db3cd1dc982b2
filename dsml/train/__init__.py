"""Data-parallel training strategies and gradient compression (train layer).

Above the communicator, beside `dsml.ps`: every rank holds the whole model and the
strategy decides what is averaged and when. One interface for all of them, so a script
switches with one argument:

    async with dsml.train.open_strategy(comm, params, strategy="local_sgd", period=8,
                                        optimizer=dsml.ps.SGD(0.1)) as strategy:
        for batch in my_batches:
            grads = compute(params, batch)     # mean-loss gradient of this rank's batch
            await strategy.step(params, grads)
        await strategy.finish(params)          # every rank ends with the same params

Strategies: `"grad"` (gradient averaging, every step), `"local_sgd"` (parameters averaged
every `period` steps), `"diloco"` (an outer Nesterov momentum over the averaged
pseudo-gradient). Compression for `"grad"` and `"diloco"`: `"bf16"`, `"fp16"`,
`"topk:RATIO"` and `"powersgd:RANK"` (error feedback for the last two). See docs/train.md.
"""

from .compress import (
    COMPRESSIONS,
    Cast,
    Compressor,
    NoCompression,
    PowerSGD,
    TopK,
    Traffic,
    compressor_from,
)
from .strategies import (
    STRATEGIES,
    DiLoCo,
    GradientAveraging,
    LocalSGD,
    Strategy,
    StrategyConfig,
    make_strategy,
    open_strategy,
)

__all__ = [
    "COMPRESSIONS",
    "STRATEGIES",
    "Cast",
    "Compressor",
    "DiLoCo",
    "GradientAveraging",
    "LocalSGD",
    "NoCompression",
    "PowerSGD",
    "Strategy",
    "StrategyConfig",
    "TopK",
    "Traffic",
    "compressor_from",
    "make_strategy",
    "open_strategy",
]
