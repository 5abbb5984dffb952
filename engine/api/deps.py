"""Dependencies of the engine routes: the Engine and its metrics, built once at startup."""

from __future__ import annotations

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


EngineDep = Annotated[Engine, Depends(get_engine)]
MetricsDep = Annotated[EngineMetrics, Depends(get_metrics)]
SettingsDep = Annotated[EngineSettings, Depends(get_settings)]
