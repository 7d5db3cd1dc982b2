"""Membership layer: views (epoch, members, ring order), the registry and its client."""

from .client import Listener, RegistryClient, query_status
from .registry import Registry, open_registry
from .view import Change, Member, View

__all__ = [
    "Change",
    "Listener",
    "Member",
    "Registry",
    "RegistryClient",
    "View",
    "open_registry",
    "query_status",
]
