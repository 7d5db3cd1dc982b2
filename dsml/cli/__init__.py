"""The `dsml` command (cli layer): registry, worker, run, bench, status, keys, flight.

The CLI is an edge: it reads flags and `DSML_*` variables once and passes frozen
configuration inward. Two options hold for every command and are added here, so each
command's module need not repeat them:

- `--log-level` (default `DSML_LOG_LEVEL`, else warning), also passed on to the ranks that
  `dsml run` and `dsml bench` start;
- `--registry`, wherever a command has it, defaults to `DSML_REGISTRY`;
- `--secret-file`, for every command that connects, names the job secret's file (it wins
  over `DSML_SECRET` and `DSML_SECRET_FILE`; see docs/security.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Mapping, Sequence

from .. import log
from .._version import __version__
from ..errors import DsmlError
from ..transport.secret import SECRET_ENV, SECRET_FILE_ENV, forget_secret
from . import bench, flight, keys, registry_cmd, run, status, worker

__all__ = ["build_parser", "main"]

_COMMANDS = (registry_cmd, worker, run, bench, status, keys, flight)
_LOG_LEVEL_HELP = "debug, info, warning or error (default: $DSML_LOG_LEVEL, else warning)"
_SECRET_HELP = (
    "file holding the job secret, readable by its owner only (default: $DSML_SECRET, "
    "else $DSML_SECRET_FILE, else ~/.config/dsml/secret)"
)
_OFFLINE = ("keys", "flight")  # commands that open no connection


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The parser of `dsml` and all its commands (the docs' CLI reference is made from it)."""
    env = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="dsml",
        description="Peer-to-peer collectives for machine-learning workers (ZeroMQ + asyncio).",
    )
    parser.add_argument("--version", action="version", version=f"dsml {__version__}")
    parser.add_argument("--log-level", metavar="LEVEL", type=_log_level, help=_LOG_LEVEL_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in _COMMANDS:
        command.add_parser(sub)
    for command_parser in _subparsers(parser):
        # SUPPRESS: `dsml --log-level debug run ...` is not undone by run's own default
        command_parser.add_argument(
            "--log-level",
            metavar="LEVEL",
            type=_log_level,
            default=argparse.SUPPRESS,
            help=_LOG_LEVEL_HELP,
        )
        name = command_parser.prog.split()[1]  # "dsml keys generate": keys
        if name not in _OFFLINE:
            command_parser.add_argument(
                "--secret-file", metavar="FILE", default=argparse.SUPPRESS, help=_SECRET_HELP
            )
        _registry_from_env(command_parser, env.get("DSML_REGISTRY"))
        _default_from_env(command_parser, "curve_keys", env.get("DSML_CURVE_KEYS", "").strip())
    return parser


def _split_joined_module(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`dsml run ... -mMODULE ARGS` as `-m MODULE ARGS`: argparse reads the one-word form
    as -m's only value and would take the module's options for dsml run's. Only among
    dsml run's own options: a script's `-mX` is the script's."""
    if "run" not in argv:
        return argv
    run = next(p for p in _subparsers(parser) if p.prog.endswith(" run"))
    takes_value = {s for a in run._actions if a.nargs != 0 for s in a.option_strings}
    i = argv.index("run") + 1
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        token = argv[i]
        if token.startswith("-m") and len(token) > 2:
            return [*argv[:i], "-m", token[2:], *argv[i + 1 :]]
        i += 2 if token in takes_value else 1
    return argv


def _log_level(text: str) -> str:
    try:
        log.parse_level(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip().lower()


def _subparsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """Every command's parser, nested ones (`dsml keys generate`) included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases share a parser
                yield child
                yield from _subparsers(child)


def _default_from_env(parser: argparse.ArgumentParser, dest: str, value: str) -> None:
    """Make an environment variable's value the default of an option (where it is set)."""
    for action in parser._actions:
        if action.dest == dest and value and action.default is None:
            action.default = value


def _registry_from_env(parser: argparse.ArgumentParser, registry: str | None) -> None:
    """Make DSML_REGISTRY the default of a command's --registry (no longer required then)."""
    for action in parser._actions:
        if action.dest != "registry":
            continue
        text = action.help or "registry address"
        if "DSML_REGISTRY" not in text:  # one default in the help, not two
            if "(default: " in text:
                text = text.replace("(default: ", "(default: $DSML_REGISTRY, else ", 1)
            else:
                text += " (default: $DSML_REGISTRY)"
            action.help = text
        if registry and action.default is None:
            action.default = registry
            action.required = False


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `dsml` and `python -m dsml`; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(
        _split_joined_module(parser, [*(sys.argv[1:] if argv is None else argv)])
    )
    level = args.log_level or os.environ.get("DSML_LOG_LEVEL") or "warning"
    try:
        log.parse_level(level)
    except ValueError as exc:
        parser.error(str(exc))
    log.configure(level, stream=sys.__stderr__ if args.command == "worker" else None)
    if args.log_level:  # the ranks of `dsml run` and `dsml bench` inherit it
        os.environ["DSML_LOG_LEVEL"] = args.log_level
    if getattr(args, "secret_file", None):  # the ranks and daemons it starts inherit it
        os.environ.pop(SECRET_ENV, None)
        os.environ[SECRET_FILE_ENV] = os.path.abspath(args.secret_file)
        forget_secret()
    try:
        code: int = args.handler(args)
    except DsmlError as exc:
        print(f"dsml {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code
