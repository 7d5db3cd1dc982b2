"""`open_*` results that work both with `await` and with `async with` (leaf module)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["AsyncOnly", "AsyncResource", "Opener"]


class AsyncResource(Protocol):
    async def aclose(self) -> None: ...


class AsyncOnly:
    """A mixin for objects entered with `async with` only: a plain `with` raises a
    TypeError that says what to write (`_ASYNC_HINT`), not Python's generic one."""

    _ASYNC_HINT = "use `async with` inside a coroutine"

    def _sync_misuse(self) -> str:
        return self._ASYNC_HINT

    def __enter__(self) -> None:
        raise TypeError(self._sync_misuse())

    def __exit__(self, *exc: object) -> None:  # pragma: no cover - __enter__ raised
        return None


R = TypeVar("R", bound=AsyncResource)


class Opener(AsyncOnly, Generic[R]):
    """`await opener` gives the resource; `async with opener as r` also closes it."""

    def __init__(self, open_fn: Callable[[], Awaitable[R]], name: str | None = None) -> None:
        self._open_fn = open_fn
        # `dsml.init` for the closure `init.<locals>.open_communicator`
        qualname = getattr(open_fn, "__qualname__", "open")
        self._name = name or f"dsml.{qualname.split('.<locals>')[0]}"
        self._resource: R | None = None

    def __repr__(self) -> str:
        # What `asyncio.run(dsml.init())` shows in its "a coroutine was expected" error.
        var = self._var
        return (
            f"{self._name}(...), which is not a coroutine: use it inside one, as in "
            f"`async def main(): async with {self._name}(...) as {var}: ...` and then "
            f"`asyncio.run(main())`"
        )

    def __await__(self) -> Generator[Any, None, R]:
        return self._open().__await__()

    # The usual slips: a plain `with`, or a forgotten `await` (then the first method call
    # lands here). Each says what to write instead, not Python's generic error.

    @property
    def _var(self) -> str:
        """What the examples in its messages call the opened resource."""
        return {"dsml.init": "comm", "dsml.open_registry": "registry"}.get(self._name, "it")

    def _misuse(self, what: str) -> str:
        var = self._var
        hint = (
            " (or, in synchronous code, `with dsml.blocking.init() as comm:` after "
            "`import dsml.blocking`)"
            if self._name == "dsml.init"
            else ""
        )
        return (
            f"{what}: {self._name}(...) opens asynchronously; inside a coroutine write "
            f"`async with {self._name}(...) as {var}:` or `{var} = await {self._name}(...)`"
            f"{hint}"
        )

    def _sync_misuse(self) -> str:
        return self._misuse("a plain `with` cannot open it")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        what = f"`.{name}` of what {self._name}(...) returns, not awaited"
        raise OpenerMisuse(self._misuse(what))

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


class OpenerMisuse(AttributeError, TypeError):
    """An attribute of an opener asked for as if it were what it opens (an `await`
    forgotten); an AttributeError too, so `hasattr` and `getattr(..., default)` still
    answer as they would."""
