"""The `ragblend` command: one subcommand per service or tool.

Each subcommand lives in its own package as a module exposing `add_parser(subparsers)`; the
parser stores the function to run in `args.run`.
"""

from __future__ import annotations

import argparse
import importlib

from common.request_id import configure_logging
from ragblend.children import exit_with_parent

SUBCOMMAND_MODULES = (
    "engine.cli",
    "retriever.cli",
    "gateway.cli",
    "ragblend.up",
    "evaluation.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ragblend", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    exit_with_parent()
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    return int(args.run(args) or 0)
