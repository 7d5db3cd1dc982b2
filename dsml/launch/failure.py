"""How a rank of `dsml run` failed, and which failure is the root cause (launch layer).

A `Failure` is what the launcher knows of a rank that ended badly: its exit code and the
last lines of its error output, from which `consequence` tells whether it failed only
because another rank did (its error says so: `errors.caused_by_another_rank`). The
launcher names the first failure that is no consequence; the launchers of a multi-node
run send failures to each other (nodes.py), also for a node interrupted or lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .._process import describe_exit
from ..errors import caused_by_another_rank

__all__ = ["Failure", "error_of"]


@dataclass
class Failure:
    rank: int
    code: int
    tail: list[str] = field(default_factory=list)
    node: int | None = None  # with --nnodes: the node it ran on
    host: str = ""
    signal: str = ""  # not a rank's failure: that node's launcher got this signal (SIGINT)
    lost: str = ""  # not a rank's failure: that node's launcher was lost (how it was noticed)

    @property
    def consequence(self) -> bool:
        """True when this rank only failed because another one did (as its error says)."""
        if self.signal or self.lost:
            return False  # an interrupted or lost node is the cause of what its peers see
        error = error_of(self.tail) or self.tail[-1:]
        if not error:
            return False
        name, _, message = error[0].partition(":")
        return caused_by_another_rank(name, message)

    def report(self) -> str:
        if self.signal:
            return (
                f"dsml run: node {self.node} ({self.host}) was interrupted by {self.signal}; "
                "the other ranks were stopped."
            )
        if self.lost:
            return (
                f"dsml run: node {self.node} ({self.host or 'unknown host'}) was lost: "
                f"{self.lost}; the other ranks were stopped."
            )
        where = f" on node {self.node} ({self.host})" if self.node is not None else ""
        lines = [
            f"dsml run: rank {self.rank}{where} failed ({describe_exit(self.code)}); "
            "the other ranks were stopped."
        ]
        error = error_of(self.tail)
        if error:  # its traceback was printed above, with the rank's other output
            lines.append(f"---- rank {self.rank}'s error (traceback above) ----")
            lines += [f"  {line}" for line in error]
            lines.append("----")
        elif self.tail:
            lines.append(f"---- last lines rank {self.rank} wrote to stderr ----")
            lines += [f"  {line}" for line in self.tail]
            lines.append("----")
        return "\n".join(lines)


def error_of(tail: list[str]) -> list[str]:
    """The exception lines that end a Python traceback in `tail` ([] if it holds none):
    a full one, dsml's short report (`_report.py`), or the end of one whose header
    scrolled out of the tail."""
    starts = [i for i, line in enumerate(tail) if line.startswith("Traceback (most recent")]
    frames = [i for i, line in enumerate(tail) if line.startswith('  File "')]
    if not starts and not frames:
        return []
    # The last frame line, then its source and caret lines (indented 4), then the error:
    # its message may go on over lines of any indentation.
    end = starts[-1] if starts else frames[0]
    end = max([end, *(i for i in frames if i >= end)])
    end += 1
    while end < len(tail) and tail[end].startswith("    "):
        end += 1
    return tail[end:]
