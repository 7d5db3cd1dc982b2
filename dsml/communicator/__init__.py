"""Communicator layer: binds a view and the transport into a Group for every call.

Public methods, fingerprints, aborts, timeouts; see `communicator.py` for the API, and
docs/architecture.md for the objects it is made of (`Session`, `RootLife`, `Groups`).
"""

from .collective_handle import CollectiveHandle
from .communicator import Communicator
from .init import init

__all__ = ["CollectiveHandle", "Communicator", "init"]
