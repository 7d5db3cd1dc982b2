"""Exception tree of dsml (leaf module, importable from every layer).

Who is at fault shows in the type: a `ConfigError` is the caller's, a `ProtocolError` the
sender's of a malformed message, a `CollectiveMismatchError` a disagreement between ranks, a
`PeerLostError` a member that went away. Structured facts are attributes as well as text.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "CollectiveAbortedError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "ConcurrentCallsError",
    "ConfigError",
    "DependencyFailedError",
    "DsmlError",
    "EvictedError",
    "JobTimeoutError",
    "JoinTimeoutError",
    "MemberLeftError",
    "MembershipChangedError",
    "NoQuorumError",
    "PeerLostError",
    "ProtocolError",
    "RegistryUnavailableError",
    "RemoteError",
    "WorkerLostError",
    "caused_by_another_rank",
]


class DsmlError(Exception):
    """Base class of every error dsml raises on purpose."""


class ConfigError(DsmlError, ValueError):
    """An argument, setting or local input is invalid; no data was sent (a refused
    collective still takes its turn, so the peers' matching call fails too)."""


class ConcurrentCallsError(ConfigError):
    """A collective was called from a thread while calls made from another thread were
    still in flight on the same communicator: such calls have no order every rank
    shares. The refused call took no collective id and sent nothing."""


class ProtocolError(DsmlError):
    """A message was malformed, too large, of an unknown version or otherwise foreign."""


class RegistryUnavailableError(DsmlError, ConnectionError):
    """The registry did not answer in time, or refused the request."""

    def __init__(self, message: str, *, address: str | None = None) -> None:
        super().__init__(message)
        self.address = address


class CollectiveError(DsmlError):
    """A collective failed; `rank`, `epoch`, `cid` and `collective` say which and where."""

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        epoch: int | None = None,
        cid: int | None = None,
        collective: str | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.epoch = epoch
        self.cid = cid
        self.collective = collective


class CollectiveMismatchError(CollectiveError):
    """Ranks called different collectives, or the same one with different arguments.

    `ranks` holds the two ranks whose calls disagree (when known).
    """

    def __init__(self, message: str, *, ranks: Sequence[int] = (), **where: object) -> None:
        super().__init__(message, **where)  # type: ignore[arg-type]
        self.ranks = tuple(ranks)


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not finish in time; `missing` names the ranks that did not arrive."""

    def __init__(self, message: str, *, missing: Sequence[int] = (), **where: object) -> None:
        super().__init__(message, **where)  # type: ignore[arg-type]
        self.missing = tuple(missing)


class CollectiveAbortedError(CollectiveError):
    """Another rank gave up this collective (it failed or was cancelled there)."""

    def __init__(self, message: str, *, origin: int | None = None, **where: object) -> None:
        super().__init__(message, **where)  # type: ignore[arg-type]
        self.origin = origin


class MembershipChangedError(CollectiveError):
    """The group changed (a new view) while the collective was in flight."""


class PeerLostError(MembershipChangedError):
    """A member died or became unreachable during the collective; `lost` names it."""

    def __init__(self, message: str, *, lost: Sequence[int] = (), **where: object) -> None:
        super().__init__(message, **where)  # type: ignore[arg-type]
        self.lost = tuple(lost)


class MemberLeftError(MembershipChangedError):
    """A member closed its communicator (a graceful leave) before this collective; `left`
    names its rank. The call after it runs in the view without that member."""

    def __init__(self, message: str, *, left: Sequence[int] = (), **where: object) -> None:
        super().__init__(message, **where)  # type: ignore[arg-type]
        self.left = tuple(left)


class NoQuorumError(MembershipChangedError):
    """Members were lost while the registry was away and this side is no majority of the
    view: it may not go on alone. It waits for the registry, which says which group goes
    on (this side may be dropped and must then join again)."""


class EvictedError(MembershipChangedError):
    """This worker was declared dead by the registry (silent for too long) and is no longer
    a member; it may join again as a new member."""


class DependencyFailedError(DsmlError):
    """An engine op did not run because an op it depends on failed (see `__cause__`)."""


class JoinTimeoutError(DsmlError, TimeoutError):
    """The group did not form in time: fewer members than `world_size` joined."""


class RemoteError(DsmlError):
    """A job's function failed on a worker; `rank` says where, `traceback` is the remote one.

    `error_type` is the remote exception's qualified class name (e.g. "ValueError"); the
    exception itself stays on the worker (nothing is unpickled from workers).
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        traceback: str = "",
        error_type: str = "",
        worker: str = "",
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback
        self.error_type = error_type
        self.worker = worker


class WorkerLostError(RemoteError):
    """A worker daemon died or disconnected while it ran a job (no remote traceback)."""


class JobTimeoutError(DsmlError, TimeoutError):
    """A job did not finish within `client.run(..., timeout=)`; it was cancelled."""


#: In the message of the `CollectiveTimeoutError` a rank raises when a peer that timed
#: out probes it (and so gives the call up): a consequence, not where the hang is.
GAVE_UP = "and gave it up"


def caused_by_another_rank(type_name: str, message: str = "") -> bool:
    """True when `type_name`, an error's class as a traceback prints it
    ("dsml.errors.MemberLeftError"), is one a rank raises because another rank failed or
    left: an abort or a membership change, subclasses included, or a timeout another rank
    gave up (`message` says so). Launchers name the rank with any other error as a crash's
    root cause; the daemon client counts every timeout as a consequence besides."""
    module, _, name = type_name.rpartition(".")
    kind = globals().get(name) if module == __name__ else None
    if not isinstance(kind, type):
        return False
    if issubclass(kind, CollectiveTimeoutError) and GAVE_UP in message:
        return True
    return issubclass(kind, (CollectiveAbortedError, MembershipChangedError))
