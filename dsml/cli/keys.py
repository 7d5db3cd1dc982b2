"""`dsml keys generate DIR`: CURVE key pairs for registry, workers and clients (cli layer)."""

from __future__ import annotations

import argparse
from typing import Any

from ..transport import generate_keys

__all__ = ["add_curve_keys_option", "add_parser"]

_ADVICE = """\
Copy {dir} to every host of the cluster. Registry and worker hosts need server.key_secret
and {dir}/authorized; a client host needs only server.key and its own pair
({client}.key, {client}.key_secret). A client is allowlisted by its public key
({client}.key) in {dir}/authorized on the registry and worker hosts (this command put it
there); remove it from there to revoke. Keep every .key_secret file private."""


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "keys",
        help="manage the CURVE keys that encrypt and authenticate a cluster's links",
        description="Manage the ZeroMQ CURVE keys of a cluster.",
    )
    commands = parser.add_subparsers(dest="keys_command", metavar="SUBCOMMAND")
    commands.required = True
    generate = commands.add_parser(
        "generate",
        help="create a key folder, or add a client pair to one",
        description="Create DIR with the server pair, a client pair and the allowlist "
        "DIR/authorized; on a folder that has the server pair, add one client pair.",
    )
    generate.add_argument("dir", metavar="DIR", help="the key folder (created if needed)")
    generate.add_argument(
        "--client",
        default="client",
        metavar="NAME",
        help="name of the client pair to add (default: %(default)s)",
    )
    generate.set_defaults(handler=_generate)


def _generate(args: argparse.Namespace) -> int:
    written = generate_keys(args.dir, client=args.client)  # ConfigError: main exits 2
    for path in written:
        print(f"wrote {path}")
    print()
    print(_ADVICE.format(dir=args.dir.rstrip("/") or "/", client=args.client))
    return 0


def add_curve_keys_option(parser: argparse.ArgumentParser, what: str) -> None:
    """`--curve-keys DIR`; `build_parser` makes DSML_CURVE_KEYS its default (as the ranks
    read it)."""
    parser.add_argument("--curve-keys", metavar="DIR", help=f"{what} (default: $DSML_CURVE_KEYS)")
