"""`dsml flight DIR`: read a job's flight records and name the stuck rank (cli layer)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..flight import read_records, verdict

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "flight",
        help="read a job's flight records: which rank stopped where",
        description="Read the flight records the ranks of a job wrote into DIR (their "
        "DSML_FLIGHT_DIR) and say which rank the others waited for and what it was doing.",
    )
    parser.add_argument("dir", metavar="DIR", help="the folder of the job's flight records")
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON")
    parser.set_defaults(handler=_main)


def _main(args: argparse.Namespace) -> int:
    found = verdict(read_records(args.dir))  # ConfigError (no such folder): main exits 2
    if args.json:
        print(json.dumps(found.as_dict(), indent=1))
    else:
        print("\n".join(found.lines))
    return 0 if found.cid is not None or found.ranks else 1
