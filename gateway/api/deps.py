"""Dependencies of the gateway routes: the parts built once at startup, and the request's id
and arrival time set by the middleware."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request

from gateway.ingest import IngestTracker
from gateway.metrics import GatewayMetrics
from gateway.pipeline import Pipeline
from gateway.settings import GatewaySettings


def get_settings(request: Request) -> GatewaySettings:
    return request.app.state.settings


def get_pipeline(request: Request) -> Pipeline:
    return request.app.state.pipeline


def get_ingest(request: Request) -> IngestTracker:
    return request.app.state.ingest


def get_metrics(request: Request) -> GatewayMetrics:
    return request.app.state.metrics


def get_request_id(request: Request) -> str:
    return request.state.request_id


SettingsDep = Annotated[GatewaySettings, Depends(get_settings)]
PipelineDep = Annotated[Pipeline, Depends(get_pipeline)]
IngestDep = Annotated[IngestTracker, Depends(get_ingest)]
MetricsDep = Annotated[GatewayMetrics, Depends(get_metrics)]
RequestIdDep = Annotated[str, Depends(get_request_id)]


def resolve_top_k(top_k: int | None, settings: GatewaySettings) -> int:
    """The request's top_k, or the default; 422 above max_top_k (a setting, so not in the
    schema)."""
    if top_k is None:
        return settings.default_top_k
    if top_k > settings.max_top_k:
        raise HTTPException(
            422, detail=f"top_k: must be between 1 and {settings.max_top_k}, got {top_k}"
        )
    return top_k


def resolve_max_tokens(max_tokens: int | None, settings: GatewaySettings) -> int:
    if max_tokens is None:
        return settings.default_max_tokens
    if max_tokens > settings.max_tokens_limit:
        raise HTTPException(
            422,
            detail=f"max_tokens: must be at most {settings.max_tokens_limit}, got {max_tokens}",
        )
    return max_tokens
