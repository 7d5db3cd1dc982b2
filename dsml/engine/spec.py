"""Checking and normalising what is pushed, shared by both engines (engine layer).

Everything a caller can get wrong in `push` is caught here, before the op exists, and
raised as `ConfigError` with a message that says what to do. The error an op gets when it
touches a poisoned var is built here too, so both engines word it the same way.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Iterable
from types import CodeType, CoroutineType
from typing import Any

from ..errors import ConfigError, DependencyFailedError
from .handle import Poison
from .var import Var

__all__ = [
    "check_callable",
    "coroutine_not_started",
    "dependency_error",
    "is_coroutine_fn",
    "op_name",
    "split_vars",
]


def split_vars(
    owner: object, engine_name: str, read: Iterable[Var], mutate: Iterable[Var]
) -> tuple[tuple[Var, ...], tuple[Var, ...]]:
    """Return (reads, mutates) without duplicates; a var in both counts as mutated.

    Raises:
        ConfigError: an entry is not a var of this engine, or a bare var was passed.
    """
    mutates = _unique(owner, engine_name, "mutate", mutate)
    reads = _unique(owner, engine_name, "read", read)
    if mutates:
        for var in reads:
            if var in mutates:
                return tuple(v for v in reads if v not in mutates), mutates
    return reads, mutates


def _unique(owner: object, engine_name: str, what: str, vars_: Iterable[Var]) -> tuple[Var, ...]:
    if isinstance(vars_, Var):
        raise ConfigError(f"{what}= takes a list of vars, got the single var {vars_.name!r}")
    try:
        items = tuple(vars_)
    except TypeError:
        raise ConfigError(
            f"{what}= takes a list of vars, got {type(vars_).__name__} (use [] for none)"
        ) from None
    for var in items:
        if not isinstance(var, Var):
            raise ConfigError(
                f"{what}= must hold vars made by engine.new_var(), got {type(var).__name__}"
            )
        if var._owner is not owner:
            same = " (another engine of the same name)" if var.engine_name == engine_name else ""
            raise ConfigError(
                f"var {var.name!r} belongs to engine {var.engine_name!r}, not to engine "
                f"{engine_name!r}{same}; create vars with the new_var() of the engine you "
                "push to"
            )
    return items if len(items) < 2 else tuple(dict.fromkeys(items))


def op_name(fn: Callable[..., Any], name: str | None) -> str:
    """Return the op's display name: `name`, else the function's name."""
    if name is not None:
        return name
    inner = getattr(fn, "func", fn)  # functools.partial
    return str(getattr(inner, "__qualname__", None) or type(inner).__name__)


def is_coroutine_fn(fn: Callable[..., Any]) -> bool:
    """Return True if calling `fn` makes a coroutine (async def, a partial of one, or an
    object whose `__call__` is async)."""
    code = getattr(fn, "__code__", None)  # functions, lambdas, bound methods: the fast path
    if isinstance(code, CodeType):
        return bool(code.co_flags & inspect.CO_COROUTINE)
    if inspect.iscoroutinefunction(fn):
        return True
    # An object with `async def __call__`: look at its class's method.
    return inspect.iscoroutinefunction(type(fn).__call__)


def coroutine_not_started(task: asyncio.Future[Any]) -> bool:
    """Return True if `task` runs a coroutine whose body has not started yet."""
    coro = task.get_coro() if isinstance(task, asyncio.Task) else None
    if not isinstance(coro, CoroutineType):
        return False
    return inspect.getcoroutinestate(coro) == inspect.CORO_CREATED


def check_callable(fn: object) -> None:
    """Raise ConfigError unless `fn` is callable (and say how to fix the usual slips)."""
    if inspect.isasyncgenfunction(fn):  # calling it runs nothing: it would "succeed" idle
        raise ConfigError(
            f"push() needs a function or coroutine function, got the async generator "
            f"function {getattr(fn, '__name__', fn)!r}; push a coroutine that iterates it"
        )
    if callable(fn):
        return
    if inspect.iscoroutine(fn):
        fn.close()  # it will never run; close it so Python does not warn about it
        hint = "a coroutine object: pass the function itself, or lambda: fn(args)"
    elif inspect.isawaitable(fn):
        hint = (
            f"an awaitable {type(fn).__name__} that has already started: wrap the call in "
            "a lambda so the engine starts it when its dependencies allow"
        )
    else:
        hint = f"{type(fn).__name__}; bind arguments with a lambda or functools.partial"
    raise ConfigError(f"push() needs a callable taking no arguments, got {hint}")


def dependency_error(what: str, var: Var, poison: Poison) -> DependencyFailedError:
    """Build the error for `what` (an op that did not run, a wait) meeting poisoned `var`."""
    cause = poison.error
    if isinstance(cause, asyncio.CancelledError):
        how = "was cancelled while running"
    else:
        how = f"failed with {type(cause).__name__}: {cause}"
    error = DependencyFailedError(
        f"{what}: var {var.name!r} is poisoned because op {poison.origin!r} {how}. Fix the "
        f"cause, then call engine.clear_error() on the var before pushing ops that use it again"
    )
    error.__cause__ = cause
    return error
