"""What every `ragblend SERVICE` command does: CLI flags derived from the service's settings
class, settings from those flags over RAGBLEND_* env vars, then uvicorn (probes kept quiet)."""

from __future__ import annotations

import argparse
import copy
import logging
import types
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

_SCALARS = (int, float, str, Path)
# Requested every few seconds by the gateway's health poller, `ragblend up`, load balancers and
# Prometheus: one access line each would bury the real traffic, so a successful one is DEBUG.
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})
# After SIGTERM a service drains its open requests for at most this long, then cancels them:
# a busy service still ends within the grace of `ragblend up` (15 s) and of the compose file.
GRACEFUL_SHUTDOWN_S = 10


def add_settings_flags(parser: argparse.ArgumentParser, settings_class: type[BaseSettings]) -> None:
    """One `--flag-name` per field of `settings_class`, with the field's description as help.

    Every flag defaults to None, so that a flag not given leaves the env var or the field's
    default in force. A list field takes comma-separated values.
    """
    for name, info in settings_class.model_fields.items():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, dest=name, help=_help(info), **_argument_type(info.annotation))


def _help(info: FieldInfo) -> str:
    default = "required" if info.is_required() else f"default {_shown(info)}"
    return f"{info.description} ({default})" if info.description else f"({default})"


def _shown(info: FieldInfo) -> str:
    """A field's default as its flag would take it: a list comma-separated, None as unset."""
    value = info.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, list):
        return ",".join(map(str, value)) if value else "none"
    return str(value)


def _argument_type(annotation: Any) -> dict[str, Any]:
    """argparse's `type` (and `choices`) for a field annotation."""
    if get_origin(annotation) is Annotated:
        return _argument_type(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        inner = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(inner) == 1:
            return _argument_type(inner[0])
        # e.g. float | Literal["auto"]: the first alternative that takes the text.
        alternatives = [_argument_type(arg) for arg in inner]
        metavar = "|".join(map(_metavar, alternatives))
        return {"type": _first_of(alternatives, metavar), "metavar": metavar}
    if get_origin(annotation) is Literal:
        choices = get_args(annotation)
        return {"type": type(choices[0]), "choices": choices}
    if get_origin(annotation) is list:
        (item,) = get_args(annotation)
        return {"type": _comma_separated(item), "metavar": "A,B,..."}
    if annotation is bool:  # --flag-name / --no-flag-name
        return {"action": argparse.BooleanOptionalAction}
    if annotation in _SCALARS:
        return {"type": annotation}
    raise TypeError(f"no CLI flag for a setting of type {annotation!r}")


def _first_of(alternatives: list[dict[str, Any]], name: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        for alternative in alternatives:
            try:
                value = alternative["type"](text)
            except ValueError:
                continue
            if value in alternative.get("choices", (value,)):
                return value
        raise ValueError(text)

    parse.__name__ = name  # argparse's "invalid FLOAT|auto value: 'x'"
    return parse


def _metavar(alternative: dict[str, Any]) -> str:
    if "choices" in alternative:
        return "|".join(map(str, alternative["choices"]))
    return alternative.get("metavar") or alternative["type"].__name__.upper()


def _comma_separated(item: type) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        return [item(part.strip()) for part in text.split(",") if part.strip()]

    return parse


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


def is_quiet_probe(path: str, status: int) -> bool:
    """A probe that succeeded: logged at DEBUG only (a failing one stays visible at INFO)."""
    return path.split("?", 1)[0] in PROBE_PATHS and status < 400


class QuietProbesFilter(logging.Filter):
    """On uvicorn's access log: a successful probe becomes a DEBUG record, written only when
    the access logger is enabled for DEBUG (`--log-level debug`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access record: (client, method, path with query, HTTP version, status).
        args = record.args
        if not (isinstance(args, tuple) and len(args) == 5 and isinstance(args[4], int)):
            return True
        if not is_quiet_probe(str(args[2]), args[4]):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def uvicorn_log_config() -> dict[str, Any]:
    """uvicorn's own logging configuration, with successful probes kept off its access log."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["quiet_probes"] = {"()": QuietProbesFilter}
    config["handlers"]["access"]["filters"] = ["quiet_probes"]
    return config


def serve(
    create_app: Callable[[Any], Any],
    settings: Any,
    args: argparse.Namespace,
    **uvicorn_options: Any,
) -> int:
    import uvicorn

    uvicorn_options.setdefault("timeout_graceful_shutdown", GRACEFUL_SHUTDOWN_S)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level.lower(),
        log_config=uvicorn_log_config(),
        **uvicorn_options,
    )
    return 0
