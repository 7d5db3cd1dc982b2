"""The shared deadline timer of calls with the default budget (communicator layer).

`Deadlines` is what `Runner` (runner.py) arms for a call that has the configured timeout:
one timer for all such calls instead of one per call. A call with a budget of its own gets
a timer of its own (runner_calls.py). A deadline that passes fails the call with
`DeadlinePassed`, which the runner turns into a `CollectiveTimeoutError`. The progress log
(progress.py) keeps the first moment it looks at a call the same way, with its own action.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

from .call import Call, DeadlinePassed

__all__ = ["Deadlines"]


class Deadlines:
    """The deadlines of calls that have the default budget, kept with one timer.

    Such calls start in order with the same budget, so their deadlines come in the order
    they were added: a queue, whose head is the next deadline, replaces a timer per call
    (made and cancelled on every call). Calls are dropped from the head once over.
    `due(call)` is what happens to a call still running at its deadline (by default it
    fails with `DeadlinePassed`).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        timeout: float,
        due: Callable[[Call], object] | None = None,
    ) -> None:
        self.timeout = timeout
        self._due = due or _deadline_passed
        self._loop = loop
        self._calls: collections.deque[tuple[float, Call]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None

    def add(self, call: Call) -> None:
        """Call `due(call)` once `timeout` has passed, unless the call is over by then."""
        when = self._loop.time() + self.timeout
        self._calls.append((when, call))
        if self._timer is None:
            self._timer = self._loop.call_at(when, self._expire)

    def forget_over(self) -> None:
        """Drop the calls at the head that are over (called as calls finish)."""
        calls = self._calls
        while calls and calls[0][1].over:
            calls.popleft()

    def _expire(self) -> None:
        self._timer = None
        self.forget_over()
        now = self._loop.time()
        while self._calls:
            when, call = self._calls[0]
            if when > now:
                self._timer = self._loop.call_at(when, self._expire)
                return
            self._calls.popleft()
            if not call.over:
                self._due(call)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def __repr__(self) -> str:
        return f"<Deadlines {len(self._calls)} calls, {self.timeout:g} s each>"


def _deadline_passed(call: Call) -> None:
    call.fail(DeadlinePassed())
