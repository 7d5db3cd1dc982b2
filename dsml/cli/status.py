"""`dsml status --registry ADDR`: show the group a registry knows (cli layer)."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from ..errors import RegistryUnavailableError
from ..membership import query_status

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "status",
        help="show the members of a registry's group",
        description="Show the group a registry knows; exit code 1 if it does not answer.",
    )
    parser.add_argument("--registry", required=True, help="registry address")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--wait", type=float, default=3.0, help="seconds to wait for an answer")
    parser.set_defaults(handler=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        status = asyncio.run(query_status(args.registry, registry_timeout=args.wait))
    except RegistryUnavailableError as exc:
        print(f"dsml status: {exc}")
        return 1
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(_render(args.registry, status))
    return 0


def _render(address: str, status: dict[str, Any]) -> str:
    state = "formed" if status.get("formed") else "forming"
    lines = [
        f"registry {address}: group {state}, epoch {status.get('epoch')}, "
        f"world size {status.get('world_size')}, "
        f"{status.get('dropped_messages', 0)} malformed messages dropped"
    ]
    members = status.get("members") or []
    if members:
        lines.append(f"{'rank':>4}  {'address':<28} {'host':<20} {'pid':>8}  name")
        for rank, m in enumerate(members):
            lines.append(
                f"{rank:>4}  {m['address']:<28} {m['host']:<20} {m['pid']:>8}  {m['name']}"
            )
    for m in status.get("joining") or []:
        lines.append(f"   -  {m['address']:<28} {m['host']:<20} {m['pid']:>8}  (joining)")
    return "\n".join(lines)
