"""A registry served by a thread of its own, inside a rank's process (launch layer).

Under torchrun, srun or mpirun with no registry named, the launcher's rank-0 process
serves the group's registry. It runs on its own thread and event loop, so it keeps
answering joins and heartbeats while the rank's own loop is busy in user code (a long
numpy call, a blocking `time.sleep`, a debugger at a breakpoint). The registry lives as
long as the rank's communicator: `comm.aclose()` closes it, after giving the other
members a moment to leave; it also ends with the process.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from ..config import RegistryConfig
from ..errors import ConfigError
from ..membership import Registry, open_registry

__all__ = ["HostedRegistry"]

log = logging.getLogger("dsml.launch")

_POLL_S = 0.02


class HostedRegistry:
    """A registry on a daemon thread; `start()` binds it, `aclose()` stops it."""

    def __init__(self, config: RegistryConfig, *, linger_s: float = 2.0) -> None:
        self.config = config
        self.linger_s = linger_s  # at close, how long the other members have to leave
        self.address = ""
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._serve, name="dsml-registry", daemon=True)

    def start(self, timeout_s: float = 30.0) -> str:
        """Start the thread and wait until the registry is bound; returns its address.

        Raises:
            ConfigError: the address could not be bound (in use, not this host's).
        """
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise ConfigError(f"the registry at {self.config.address} did not start in time")
        if self._error is not None:
            raise self._error
        return self.address

    def _serve(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            registry = await open_registry(config=self.config)
        except BaseException as exc:  # handed to start(), which raises it in the caller
            self._error = exc
            self._ready.set()
            return
        self.address = registry.address
        self._ready.set()
        try:
            await self._stop.wait()
            await self._wait_members_left(registry)
        finally:
            await registry.aclose()

    async def _wait_members_left(self, registry: Registry) -> None:
        deadline = time.monotonic() + self.linger_s
        # The registry has no event for "every member left"; a short poll is cheap here.
        while registry.view is not None and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(_POLL_S)

    async def aclose(self) -> None:
        """Stop serving (after at most `linger_s` for the members to leave) and join."""
        loop, stop = self._loop, self._stop
        if loop is None or stop is None or not self._thread.is_alive():
            return
        loop.call_soon_threadsafe(stop.set)
        await asyncio.to_thread(self._thread.join)

    def __repr__(self) -> str:
        state = "serving" if self._thread.is_alive() else "stopped"
        return f"<HostedRegistry {self.address or self.config.address} {state}>"
