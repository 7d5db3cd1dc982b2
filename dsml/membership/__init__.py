"""Membership layer: views (epoch, members, ring order), the registry and its client."""

from .client import RegistryClient, query_status
from .registry import Registry, open_registry
from .view import Member, View

__all__ = ["Member", "Registry", "RegistryClient", "View", "open_registry", "query_status"]
