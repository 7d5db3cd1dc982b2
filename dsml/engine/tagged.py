"""Tagged data: an array together with the var that names it (engine layer).

The lecture writes `A.data` for the array and `A.var` for its tag; `Tagged` is exactly
that pair, so engine programs read like the slides:

    A = engine.tag("A", np.zeros(4))
    engine.push(lambda: A.data.fill(2), mutate=[A.var])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from .var import Var

__all__ = ["Tagged"]

T = TypeVar("T")


@dataclass(eq=False)
class Tagged(Generic[T]):
    """A piece of data (`data`) and the engine var that tags it (`var`)."""

    data: T
    var: Var

    def __repr__(self) -> str:
        return f"Tagged({self.var.name!r}, {type(self.data).__name__})"
