"""The `odb` command line: one subcommand module each, registered here."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from odb_core.cli import bench, check, demo, fuzz, simulate
from odb_core.errors import ODBError

SUBCOMMANDS = [check, demo, simulate, fuzz, bench]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="odb",
        description="odb-core: online dynamic batching with a verified DGAP protocol.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.run(args)
    except (ODBError, ValueError) as exc:
        print(f"odb {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
