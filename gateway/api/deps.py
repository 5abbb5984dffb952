"""Dependencies of the gateway routes: the parts built once at startup, the request's id,
arrival time and API key set by the middleware, and the checks of limits that are settings."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Query, Request

from common.validation import DEFAULT_COLLECTION, CollectionName
from gateway.auth import ApiKey
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


def get_api_key(request: Request) -> ApiKey | None:
    """The caller's key; None when the gateway has no keys configured."""
    return request.state.api_key


SettingsDep = Annotated[GatewaySettings, Depends(get_settings)]
PipelineDep = Annotated[Pipeline, Depends(get_pipeline)]
IngestDep = Annotated[IngestTracker, Depends(get_ingest)]
MetricsDep = Annotated[GatewayMetrics, Depends(get_metrics)]
RequestIdDep = Annotated[str, Depends(get_request_id)]
ApiKeyDep = Annotated[ApiKey | None, Depends(get_api_key)]


def key_name(key: ApiKey | None) -> str:
    """For the log: the key's name, never the key."""
    return "-" if key is None else key.name


def forbidden(collection: str) -> HTTPException:
    return HTTPException(403, detail=f"collection {collection}: not allowed for this API key")


def document_collection(
    key: ApiKeyDep,
    collection: Annotated[
        CollectionName | None,
        Query(description="default: the key's first collection, else 'default'"),
    ] = None,
) -> str:
    """The collection of a documents request; 403 when the key may not use it."""
    if collection is None:
        if key is None or key.collections is None:
            collection = DEFAULT_COLLECTION
        else:
            collection = key.collections[0]
    if key is not None and not key.allows(collection):
        raise forbidden(collection)
    return collection


CollectionDep = Annotated[str, Depends(document_collection)]


def query_collections(requested: list[str] | None, key: ApiKey | None) -> list[str] | None:
    """The collections a query searches (None: all); by default all the key may use, and 403
    for one it may not."""
    if key is None or key.collections is None:
        return requested
    if requested is None:
        return list(key.collections)
    for collection in requested:
        if not key.allows(collection):
            raise forbidden(collection)
    return requested


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


def resolve_max_tokens(
    max_tokens: int | None, settings: GatewaySettings, max_model_len: int | None
) -> int:
    """The request's max_tokens, or the default; 422 above max_tokens_limit, or when it could
    not fit the engines' context even with an empty prompt (max_model_len, when known)."""
    if max_tokens is None:
        max_tokens = settings.default_max_tokens
    if max_tokens > settings.max_tokens_limit:
        raise HTTPException(
            422,
            detail=f"max_tokens: must be at most {settings.max_tokens_limit}, got {max_tokens}",
        )
    if max_model_len is not None and max_tokens >= max_model_len:
        raise HTTPException(
            422,
            detail=f"max_tokens: must be below the model's context of {max_model_len} "
            f"positions (max_model_len), got {max_tokens}",
        )
    return max_tokens
