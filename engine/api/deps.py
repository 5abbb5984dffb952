"""Dependencies of the engine routes: the Engine and its metrics, built once at startup, and
the text length limit of every route."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated

from fastapi import Depends, HTTPException, Request

from engine.api.metrics import EngineMetrics
from engine.api.settings import EngineSettings
from engine.engine import Engine


def get_engine(request: Request) -> Engine:
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        raise HTTPException(503, detail="engine: the model is not loaded")
    return engine


def get_metrics(request: Request) -> EngineMetrics:
    return request.app.state.metrics


def get_settings(request: Request) -> EngineSettings:
    return request.app.state.settings


def check_text_limits(texts: Iterable[tuple[str, str]], max_chars: int) -> None:
    """422 naming the first text longer than `max_chars` characters."""
    for field, text in texts:
        if len(text) > max_chars:
            raise HTTPException(
                422, detail=f"{field}: {len(text)} characters, above the limit of {max_chars}"
            )


EngineDep = Annotated[Engine, Depends(get_engine)]
MetricsDep = Annotated[EngineMetrics, Depends(get_metrics)]
SettingsDep = Annotated[EngineSettings, Depends(get_settings)]
