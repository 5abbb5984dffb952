"""What every `ragblend SERVICE` command does: settings from CLI flags over RAGBLEND_* env
vars, then uvicorn. Invalid settings end the command with a message naming the field."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from pydantic_settings import BaseSettings


def settings_from_args(
    settings_class: type[BaseSettings], args: argparse.Namespace, command: str
) -> Any:
    """The settings, with every flag that was given (not None) overriding its env var."""
    fields = set(settings_class.model_fields)
    overrides = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    try:
        return settings_class(**overrides)
    except ValidationError as exc:
        raise SystemExit(f"ragblend {command}: invalid settings:\n{exc}") from None


def serve(
    create_app: Callable[[Any], Any],
    settings: Any,
    args: argparse.Namespace,
    **uvicorn_options: Any,
) -> int:
    import uvicorn

    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level.lower(),
        **uvicorn_options,
    )
    return 0
