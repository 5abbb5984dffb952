"""`ragblend engine`: serve the engine over HTTP (settings from flags or RAGBLEND_ENGINE_*)."""

from __future__ import annotations

import argparse
import sys

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
    from engine.errors import ModelNotFoundError, ModelNotSupportedError
    from engine.model.load import resolve_checkpoint

    settings = settings_from_args(EngineSettings, args, "engine")
    # A GGUF is converted (or found converted) before the server starts, so that a damaged
    # file or another architecture is one line, not a traceback from the app's startup.
    try:
        resolve_checkpoint(settings.model)
    except (ModelNotFoundError, ModelNotSupportedError) as exc:
        print(f"ragblend engine: error: {exc}", file=sys.stderr)
        return 2
    return serve(create_app, settings, args)
