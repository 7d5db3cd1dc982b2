"""Errors of the parameter servers (parameter-server layer), under `dsml.DsmlError`."""

from __future__ import annotations

from ..errors import DsmlError

__all__ = ["PSError", "ServerLostError"]


class PSError(DsmlError):
    """A parameter-server call failed; the message says why and what to do."""


class ServerLostError(PSError):
    """A server died or left before answering; `server` is its index. Its shard is gone
    (without `PSConfig(replicas=1)`, or when its backup was lost too): the pending and
    later calls of every worker to it fail with this error instead of waiting."""

    def __init__(self, message: str, *, server: int) -> None:
        super().__init__(message)
        self.server = server
