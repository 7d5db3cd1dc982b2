"""The ranks' output, passed on line by line with the rank in front (launch layer).

Every line a rank writes to stdout or stderr is printed by the launcher as `[rank R] line`
on its own stdout or stderr (or given to an `on_line` callback instead, as `dsml bench`
does); the last lines of each rank's stderr are kept for the report of its failure.
"""

from __future__ import annotations

import asyncio
import collections
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TextIO

__all__ = ["LineSink", "RankOutput"]

#: on_line(rank, stream name, line) replaces the default printing when given.
LineSink = Callable[[int, str, str], None]

_TAIL_LINES = 20


class RankOutput:
    """The output of the ranks one launcher started (local rank index -> global rank)."""

    def __init__(
        self,
        ranks: Sequence[int],
        on_line: LineSink | None = None,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
    ) -> None:
        self._ranks = list(ranks)
        self._on_line = on_line
        self._stdout = stdout or sys.stdout
        self._stderr = stderr or sys.stderr
        self._closed = False  # the launcher's own output is gone (a broken pipe)
        self._tails = [collections.deque[str](maxlen=_TAIL_LINES) for _ in self._ranks]

    async def relay(
        self, index: int, stdout: asyncio.StreamReader, stderr: asyncio.StreamReader
    ) -> None:
        """Pass on what local rank `index` writes until it closes both streams."""
        await asyncio.gather(
            self._pump(index, "stdout", stdout), self._pump(index, "stderr", stderr)
        )

    def tail(self, index: int) -> list[str]:
        """The last lines local rank `index` wrote to stderr."""
        return list(self._tails[index])

    async def _pump(self, index: int, name: str, stream: asyncio.StreamReader) -> None:
        rank = self._ranks[index]
        async for text in _lines(stream):
            if name == "stderr":
                self._tails[index].append(text)
            if self._on_line is not None:
                self._on_line(rank, name, text)
            elif not self._closed:
                out = self._stdout if name == "stdout" else self._stderr
                try:
                    out.write(f"[rank {rank}] {text}\n")
                    out.flush()
                except BrokenPipeError:  # e.g. piped into `head`: keep supervising quietly
                    self._closed = True

    def __repr__(self) -> str:
        return f"<RankOutput ranks={self._ranks} closed={self._closed}>"


_MAX_LINE = 64 * 1024  # a longer stretch without a newline is passed on in pieces


async def _lines(stream: asyncio.StreamReader) -> AsyncIterator[str]:
    """The lines a rank writes, without their newline. A carriage return (a progress bar
    redrawing itself) keeps what a terminal would show: the text after the last one.
    Output without newlines is passed on every 64 KiB instead of failing."""
    pending = b""
    while chunk := await stream.read(_MAX_LINE):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if len(pending) > _MAX_LINE:
            lines.append(pending)
            pending = b""
        for line in lines:
            yield _shown(line)
    if pending:
        yield _shown(pending)


def _shown(line: bytes) -> str:
    text = line.decode(errors="replace").rstrip("\r")
    return text.rsplit("\r", 1)[-1]
