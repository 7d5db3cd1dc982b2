"""Registers the torch.distributed backend "dsml" when torch is imported.

torch loads the entry points of the group "torch.backends" at the end of `import torch`
(set TORCH_DEVICE_BACKEND_AUTOLOAD=0 to turn that off), so `dist.init_process_group("dsml")`
works without `import dsml.torch` first. This module lies outside the dsml package, since
importing a submodule runs `dsml/__init__.py` (ZeroMQ, numpy, the whole library): dsml loads
on the first group made with backend "dsml", so an `import torch` in a program that never
uses dsml costs nothing more.

A failure here must not break `import torch` (torch turns an exception from an entry point
into a RuntimeError of the import), so it is logged and swallowed: `import dsml.torch`
still registers the backend and says what is wrong.
"""

from __future__ import annotations

import logging
from typing import Any

BACKEND = "dsml"


def create_backend(*args: Any, **kwargs: Any) -> Any:
    """torch's backend creator, resolved on first use."""
    from dsml.torch import create_backend as create

    return create(*args, **kwargs)


def register() -> None:
    """The entry point torch calls: register "dsml" unless something already did."""
    try:
        import torch.distributed as dist

        if not dist.is_available() or BACKEND in dist.Backend.backend_list:
            return
        dist.Backend.register_backend(BACKEND, create_backend, devices=["cpu", "cuda"])
    except Exception as exc:  # never break `import torch`
        logging.getLogger("dsml").debug("torch backend autoload skipped: %r", exc)
