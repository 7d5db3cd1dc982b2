"""`open_*` results that work both with `await` and with `async with` (leaf module)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["AsyncResource", "Opener"]


class AsyncResource(Protocol):
    async def aclose(self) -> None: ...


R = TypeVar("R", bound=AsyncResource)


class Opener(Generic[R]):
    """`await opener` gives the resource; `async with opener as r` also closes it."""

    def __init__(self, open_fn: Callable[[], Awaitable[R]], name: str | None = None) -> None:
        self._open_fn = open_fn
        # `dsml.init` for the closure `init.<locals>.open_communicator`
        qualname = getattr(open_fn, "__qualname__", "open")
        self._name = name or f"dsml.{qualname.split('.<locals>')[0]}"
        self._resource: R | None = None

    def __repr__(self) -> str:
        # What `asyncio.run(dsml.init())` shows in its "a coroutine was expected" error.
        var = {"dsml.init": "comm", "dsml.open_registry": "registry"}.get(self._name, "it")
        return (
            f"{self._name}(...), which is not a coroutine: use it inside one, as in "
            f"`async def main(): async with {self._name}(...) as {var}: ...` and then "
            f"`asyncio.run(main())`"
        )

    def __await__(self) -> Generator[Any, None, R]:
        return self._open().__await__()

    async def _open(self) -> R:
        return await self._open_fn()

    async def __aenter__(self) -> R:
        self._resource = await self._open_fn()
        return self._resource

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        resource, self._resource = self._resource, None
        if resource is None:
            return
        if hasattr(resource, "__aexit__"):  # it wants to know how the block ended
            await resource.__aexit__(exc_type, exc, tb)
        else:
            await resource.aclose()
