"""The `dsml` command (cli layer): registry, run, bench, status, keys.

The CLI is an edge: it reads flags and `DSML_*` variables once and passes frozen
configuration inward.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .._version import __version__
from ..errors import DsmlError
from . import bench, keys, registry_cmd, run, status, worker

__all__ = ["main"]

_COMMANDS = (registry_cmd, worker, run, bench, status, keys)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsml",
        description="Peer-to-peer collectives for machine-learning workers (ZeroMQ + asyncio).",
    )
    parser.add_argument("--version", action="version", version=f"dsml {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in _COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `dsml` and `python -m dsml`; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.handler(args)
    except DsmlError as exc:
        print(f"dsml {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code
