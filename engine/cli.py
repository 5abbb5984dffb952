"""`ragblend engine`: serve the engine over HTTP (settings from flags or RAGBLEND_ENGINE_*)."""

from __future__ import annotations

import argparse

from common.serving import serve, settings_from_args


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "engine", help="run the engine service", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", help="checkpoint directory or hub id in the local cache")
    parser.add_argument("--device", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--store-path", help="directory of the SSD tier")
    parser.add_argument("--memory-budget-gb", type=float)
    parser.add_argument("--ssd-budget-gb", type=float)
    parser.add_argument("--lookahead", type=int, help="layers the KV loader runs ahead")
    parser.add_argument("--queue-depth", type=int, help="generations that may wait (then 429)")
    parser.add_argument("--recompute-ratio", type=float, help="fixed ratio (default: controller)")
    parser.add_argument("--min-recompute-ratio", type=float)
    parser.add_argument(
        "--check-layers",
        type=lambda s: [int(x) for x in s.split(",")],
        help="comma-separated check layers, e.g. 1 or 1,2,3",
    )
    parser.add_argument("--max-tokens-limit", type=int, help="largest max_tokens accepted")
    parser.add_argument("--system-prompt")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from engine.api.main import create_app
    from engine.api.settings import EngineSettings

    return serve(create_app, settings_from_args(EngineSettings, args, "engine"), args)
