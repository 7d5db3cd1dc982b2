"""`dsml status --registry ADDR`: show the group a registry knows (cli layer).

Once (text or `--json`), as a refreshing table (`--watch`), or as a read-only web page
(`--serve [ADDR]`, dsml/status_page.py); the text is dsml/status_view.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

from ..errors import ConfigError, RegistryUnavailableError
from ..membership import query_status
from ..status_page import StatusPoller, page_token, serve
from ..status_view import render, with_marks
from ..transport import Curve, job_secret
from .keys import add_curve_keys_option

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "status",
        help="show a registry's group and its worker daemons",
        description="Show the group a registry knows; exit code 1 if it does not answer.",
    )
    parser.add_argument("--registry", help="registry address")  # or DSML_REGISTRY
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--wait", type=float, default=3.0, help="seconds to wait for an answer (default: 3)"
    )
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument(
        "--watch", action="store_true", help="refresh the table every --interval (Ctrl-C stops)"
    )
    shown.add_argument(
        "--serve",
        nargs="?",
        const=SERVE_DEFAULT,
        metavar="ADDR",
        help=f"serve a read-only web page of the job at HOST:PORT (default {SERVE_DEFAULT}; "
        "port 0: any free one); it has no login: name a public address only on a trusted net",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=1.0,
        help="seconds between refreshes of --watch and --serve (default: 1)",
    )
    add_curve_keys_option(parser, "CURVE keys, for a registry started with them")
    parser.set_defaults(handler=_main)


SERVE_DEFAULT = "127.0.0.1:8765"


def _main(args: argparse.Namespace) -> int:
    if not args.registry:
        print(
            "dsml status: no registry: pass --registry tcp://HOST:PORT or set DSML_REGISTRY",
            file=sys.stderr,
        )
        return 2
    try:
        if not args.wait > 0:
            raise ConfigError(f"--wait must be a positive number of seconds, not {args.wait}")
        if not args.interval > 0:
            raise ConfigError(
                f"--interval must be a positive number of seconds, not {args.interval}"
            )
        curve = _curve(args.curve_keys) if args.curve_keys else None
        if args.watch or args.serve:
            return _refreshing(args, curve)
        status = asyncio.run(query_status(args.registry, registry_timeout=args.wait, curve=curve))
    except (RegistryUnavailableError, ConfigError) as exc:
        print(f"dsml status: {exc}", file=sys.stderr)
        if args.json:
            print(json.dumps({"error": str(exc), "registry": args.registry}))
        return 1
    if args.json:
        print(json.dumps(with_marks(status), indent=2))
    else:
        print(render(args.registry, status))
    return 0


def _refreshing(args: argparse.Namespace, curve: Curve | None) -> int:
    """`--watch` or `--serve`, until Ctrl-C or SIGTERM (exit code 0)."""
    with _sigterm_interrupts():
        try:
            if args.serve:
                _serve(args, curve)
            else:
                _watch(args, curve)
        except KeyboardInterrupt:
            pass
    return 0


def _watch(args: argparse.Namespace, curve: Curve | None) -> None:
    """Print the table every interval: over the last one on a terminal, else one after
    another, a blank line between."""
    clear = sys.stdout.isatty()
    while True:
        try:
            status = asyncio.run(
                query_status(args.registry, registry_timeout=args.wait, curve=curve)
            )
            text = render(args.registry, status)
        except RegistryUnavailableError as exc:  # it may come back: keep asking
            text = f"dsml status: {exc} (asking again)"
        stamp = time.strftime("%H:%M:%S")
        frame = f"{stamp}, every {args.interval:g} s (Ctrl-C stops)\n{text}\n"
        sys.stdout.write(("\x1b[H\x1b[2J" if clear else "\n") + frame)
        sys.stdout.flush()
        time.sleep(args.interval)


def _serve(args: argparse.Namespace, curve: Curve | None) -> None:
    host, port = _host_port(args.serve)
    poller = StatusPoller(args.registry, args.interval, args.wait, curve).start()
    try:
        token = page_token(job_secret())
        server = serve(poller, host, port, token)
    except OSError as exc:
        poller.stop()
        raise ConfigError(f"--serve {args.serve}: cannot listen there ({exc})") from exc
    bound_host, bound_port = str(server.server_address[0]), int(server.server_address[1])
    shown = f"[{bound_host}]" if ":" in str(bound_host) else bound_host
    print(
        f"dsml status: serving http://{shown}:{bound_port}/{token}/ (Ctrl-C stops; the path "
        "is derived from the job secret: whoever holds it can find the page, nobody else)",
        flush=True,
    )
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        poller.stop()


def _host_port(text: str) -> tuple[str, int]:
    """HOST:PORT, [V6]:PORT or PORT (on loopback) for --serve."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        ipaddress.ip_address(host)
        number = int(port)
        if not 0 <= number < 65536:
            raise ValueError(port)
    except ValueError:
        raise ConfigError(
            f"--serve {text}: give HOST:PORT with an IP address (as 127.0.0.1:8765), or PORT"
        ) from None
    return host, number


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM stops a refreshing status as Ctrl-C does (a clean exit, code 0)."""

    def interrupt(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _curve(directory: str) -> Curve:
    """This host's client key pair if it has one, else the cluster's server pair."""
    try:
        return Curve.load(directory, role="client")
    except ConfigError:
        return Curve.load(directory, role="server")
