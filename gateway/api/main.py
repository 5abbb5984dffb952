"""The gateway app: builds the dependency clients and the engine health poller at startup,
closes them after the in-flight requests have drained, and mounts the routes behind the
middleware."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from common.body_limit import BodySizeLimitMiddleware
from common.request_id import REQUEST_ID_HEADER
from common.requests import RequestGuardMiddleware
from gateway.api import handlers
from gateway.api.middleware import Admission, GatewayMiddleware
from gateway.api.routes import documents, health, openai, query
from gateway.auth import ApiKeyMiddleware, load_keys
from gateway.clients.engine import EnginePool
from gateway.clients.retriever import RetrieverClient
from gateway.clients.upstream import Upstream, auth_headers
from gateway.ingest import IngestTracker
from gateway.metrics import GatewayMetrics
from gateway.pipeline import Pipeline
from gateway.settings import GatewaySettings
from gateway.tenancy import CacheScope

log = logging.getLogger(__name__)
UPLOAD_PATH = "/v1/documents"


def _http_client(settings: GatewaySettings) -> httpx.AsyncClient:
    # Every admitted query holds one engine connection for its whole stream.
    limits = httpx.Limits(
        max_connections=settings.max_concurrency + 32, max_keepalive_connections=32
    )
    return httpx.AsyncClient(
        limits=limits,
        timeout=settings.generate_timeout_s,
        headers=auth_headers(settings.internal_token),
    )


def create_app(settings: GatewaySettings) -> FastAPI:
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        retriever_http, engine_http = _http_client(settings), _http_client(settings)
        retry = {
            "retries": settings.retries,
            "backoff_s": settings.retry_backoff_s,
            "on_error": metrics.upstream_error,
        }
        retriever = RetrieverClient(
            Upstream("retriever", retriever_http, **retry),
            settings.retriever_url,
            connect_timeout_s=settings.connect_timeout_s,
            search_timeout_s=settings.retrieval_timeout_s,
            ingest_timeout_s=settings.ingest_timeout_s,
            health_timeout_s=settings.health_timeout_s,
        )
        engines = EnginePool(
            Upstream("engine", engine_http, **retry),
            settings.engine_urls,
            connect_timeout_s=settings.connect_timeout_s,
            generate_timeout_s=settings.generate_timeout_s,
            precompute_timeout_s=settings.precompute_timeout_s,
            ttft_timeout_s=settings.ttft_timeout_s,
            health_interval_s=settings.health_interval_s,
            health_timeout_s=settings.health_timeout_s,
        )
        await engines.start()
        app.state.pipeline = Pipeline(retriever, engines, metrics)
        scope = CacheScope(settings.cache_sharing, settings.keyed)
        app.state.ingest = IngestTracker(retriever, engines, metrics, scope)
        log.info(
            "gateway up: retriever %s, engines %s",
            settings.retriever_url,
            ", ".join(f"{e.name}={e.url}" for e in engines.engines),
        )
        try:
            yield
        finally:
            # uvicorn runs this after in-flight requests (streams included) have finished.
            await app.state.ingest.close()
            await engines.close()
            await retriever_http.aclose()
            await engine_http.aclose()

    app = FastAPI(title="ragblend gateway", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = metrics
    handlers.install(app)
    app.include_router(query.router)
    app.include_router(openai.router)
    app.include_router(documents.router)
    app.include_router(health.router)
    # The last added runs first: CORS, then request id, metrics and admission, then the
    # body limit, the Origin and content type guard, and the API key.
    app.add_middleware(ApiKeyMiddleware, keys=load_keys(settings.api_keys, settings.api_keys_file))
    app.add_middleware(
        RequestGuardMiddleware,
        allowed_origins=settings.cors_origins,
        multipart_paths={UPLOAD_PATH},
    )
    app.add_middleware(
        BodySizeLimitMiddleware,
        max_bytes=settings.max_body_bytes,
        path_limits={UPLOAD_PATH: settings.max_upload_bytes},
    )
    app.add_middleware(
        GatewayMiddleware,
        metrics=metrics,
        admission=Admission(settings.max_concurrency),
        retry_after_s=settings.retry_after_s,
    )
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type", REQUEST_ID_HEADER],
            expose_headers=[REQUEST_ID_HEADER, "Retry-After", "X-RAGBlend-Engine"],
        )
    return app
