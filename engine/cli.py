"""`ragblend engine`: serve the engine over HTTP (settings from flags or RAGBLEND_ENGINE_*)."""

from __future__ import annotations

import argparse

from common.serving import add_settings_flags, serve, settings_from_args
from engine.api.settings import EngineSettings


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "engine", help="run the engine service", description=__doc__.splitlines()[0]
    )
    add_settings_flags(parser, EngineSettings)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from engine.api.main import create_app

    return serve(create_app, settings_from_args(EngineSettings, args, "engine"), args)
