"""FastAPI dependencies: the service, settings and metrics built once at startup and
kept on `app.state`."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request

from retriever.metrics import RetrieverMetrics
from retriever.service import RetrieverService
from retriever.settings import RetrieverSettings


def get_service(request: Request) -> RetrieverService:
    service = getattr(request.app.state, "service", None)
    if service is None:
        raise HTTPException(status_code=503, detail="retriever service is not ready")
    return service


def get_settings(request: Request) -> RetrieverSettings:
    return request.app.state.settings


def get_metrics(request: Request) -> RetrieverMetrics:
    return request.app.state.metrics


ServiceDep = Annotated[RetrieverService, Depends(get_service)]
SettingsDep = Annotated[RetrieverSettings, Depends(get_settings)]
MetricsDep = Annotated[RetrieverMetrics, Depends(get_metrics)]
