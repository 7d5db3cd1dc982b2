"""`dsml status --registry ADDR`: show the group a registry knows (cli layer)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from ..errors import ConfigError, RegistryUnavailableError
from ..membership import query_status
from ..transport import Curve
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
    add_curve_keys_option(parser, "CURVE keys, for a registry started with them")
    parser.set_defaults(handler=_main)


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
        curve = _curve(args.curve_keys) if args.curve_keys else None
        status = asyncio.run(query_status(args.registry, registry_timeout=args.wait, curve=curve))
    except (RegistryUnavailableError, ConfigError) as exc:
        print(f"dsml status: {exc}", file=sys.stderr)
        if args.json:
            print(json.dumps({"error": str(exc), "registry": args.registry}))
        return 1
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(_render(args.registry, status))
    return 0


def _curve(directory: str) -> Curve:
    """This host's client key pair if it has one, else the cluster's server pair."""
    try:
        return Curve.load(directory, role="client")
    except ConfigError:
        return Curve.load(directory, role="server")


def _render(address: str, status: dict[str, Any]) -> str:
    if status.get("formed") or status.get("joining"):
        state = "formed" if status.get("formed") else "forming"
        group = f"group {state}, epoch {status.get('epoch')}, world size {status.get('world_size')}"
    else:
        epoch = status.get("epoch")
        group = f"no group running (the last one's epoch: {epoch})" if epoch else "no group yet"
    lines = [
        f"registry {address}: {group}, "
        f"{status.get('dropped_messages', 0)} malformed messages dropped"
    ]
    members = status.get("members") or []
    if members:
        lines.append(
            f"{'rank':>4}  {'address':<24} {'host:pid':<22} {'epoch':>5} {'beat':>6} "
            f"{'held':>6} {'dropped':>7}  last started / last finished"
        )
        for m in members:
            age = m.get("heartbeat_age")
            beat = f"{age:.1f}s" if isinstance(age, int | float) else "-"
            counters = m.get("counters") or {}
            held = counters.get("held", 0)
            dropped = sum(v for k, v in counters.items() if k.startswith("dropped"))
            lines.append(
                f"{m.get('rank', '?'):>4}  {m['address']:<24} "
                f"{m['host'] + ':' + str(m['pid']):<22} {m.get('epoch', 0):>5} {beat:>6} "
                f"{held:>6} {dropped:>7}  "
                f"{_call(m.get('started'))} / {_call(m.get('finished'))}"
                f"{'  ' + m['name'] if m.get('name') else ''}"
            )
    for m in status.get("joining") or []:
        lines.append(f"   -  {m['address']:<24} {m['host'] + ':' + str(m['pid']):<22} (joining)")
    for reason in status.get("refused") or []:
        lines.append(f"   -  refused {reason}")
    workers = status.get("workers") or []
    if workers:
        idle = sum(1 for w in workers if w.get("state") == "idle")
        lines.append(f"worker daemons: {idle} idle, {len(workers) - idle} busy")
        lines.append(
            f"  {'name':<16} {'state':<5} {'address':<24} {'host:pid':<22} {'device':<7} "
            f"{'beat':>6} {'jobs':>5}"
        )
        for w in workers:
            age = w.get("heartbeat_age")
            beat = f"{age:.1f}s" if isinstance(age, int | float) else "-"
            job = f"  job {w['job']}" if w.get("job") else ""
            lines.append(
                f"  {w['name']:<16} {w['state']:<5} {w['address']:<24} "
                f"{w['host'] + ':' + str(w['pid']):<22} {w['device']:<7} {beat:>6} "
                f"{w.get('jobs_done', 0):>5}{job}"
            )
    if status.get("evicted"):
        lines.append(f"evicted: {', '.join(status['evicted'])}")
    return "\n".join(lines)


def _call(progress: Any) -> str:
    """`#cid what (epoch e)` from a heartbeat's [epoch, cid, description], or '-'."""
    if not progress:
        return "-"
    epoch, cid, what = progress
    return f"#{cid} {what.split('(')[0]} (epoch {epoch})"
