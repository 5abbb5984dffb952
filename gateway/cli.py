"""`ragblend gateway`: serve the public API over the retriever and the engine pool (settings
from flags or RAGBLEND_GATEWAY_*)."""

from __future__ import annotations

import argparse

from common.serving import add_settings_flags, serve, settings_from_args
from gateway.settings import GatewaySettings


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "gateway", help="run the gateway service", description=" ".join(__doc__.split())
    )
    add_settings_flags(parser, GatewaySettings)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from gateway.api.main import create_app

    settings = settings_from_args(GatewaySettings, args, "gateway")
    # The gateway writes its own access log, once a request's last byte is sent (middleware).
    return serve(
        create_app,
        settings,
        args,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s) or None,
        access_log=False,
    )
