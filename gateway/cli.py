"""`ragblend gateway`: serve the public API over the retriever and the engine pool (settings
from flags or RAGBLEND_GATEWAY_*)."""

from __future__ import annotations

import argparse

from common.serving import serve, settings_from_args


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "gateway", help="run the gateway service", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--retriever-url")
    parser.add_argument(
        "--engine-urls", help="comma-separated engine URLs (rendezvous-hashed by chunk set)"
    )
    parser.add_argument("--max-concurrency", type=int, help="queries in flight; beyond: 429")
    parser.add_argument("--retry-after-s", type=int, help="Retry-After of those 429s")
    parser.add_argument("--default-top-k", type=int)
    parser.add_argument("--max-top-k", type=int)
    parser.add_argument("--default-max-tokens", type=int)
    parser.add_argument("--generate-timeout-s", type=float)
    parser.add_argument("--model-name", help="model id shown by /v1/models")
    parser.add_argument("--shutdown-grace-s", type=float, help="drain time for open streams")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from gateway.api.main import create_app
    from gateway.settings import GatewaySettings

    settings = settings_from_args(GatewaySettings, args, "gateway")
    return serve(
        create_app, settings, args, timeout_graceful_shutdown=int(settings.shutdown_grace_s) or None
    )
