"""The gateway app: builds the dependency clients at startup, closes them after the in-flight
requests have drained, and mounts the routes behind the middleware."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI

from gateway.api import handlers
from gateway.api.middleware import Admission, GatewayMiddleware
from gateway.api.routes import documents, health, openai, query
from gateway.clients.engine import EnginePool
from gateway.clients.retriever import RetrieverClient
from gateway.clients.upstream import Upstream
from gateway.ingest import IngestTracker
from gateway.metrics import GatewayMetrics
from gateway.pipeline import Pipeline
from gateway.settings import GatewaySettings

log = logging.getLogger(__name__)


def _http_client(settings: GatewaySettings) -> httpx.AsyncClient:
    # Every admitted query holds one engine connection for its whole stream.
    limits = httpx.Limits(
        max_connections=settings.max_concurrency + 32, max_keepalive_connections=32
    )
    return httpx.AsyncClient(limits=limits, timeout=settings.generate_timeout_s)


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
        )
        engines = EnginePool(
            Upstream("engine", engine_http, **retry),
            settings.engine_urls,
            connect_timeout_s=settings.connect_timeout_s,
            generate_timeout_s=settings.generate_timeout_s,
            precompute_timeout_s=settings.precompute_timeout_s,
        )
        app.state.pipeline = Pipeline(retriever, engines, metrics)
        app.state.ingest = IngestTracker(retriever, engines, metrics)
        log.info(
            "gateway up: retriever %s, engines %s",
            settings.retriever_url,
            ", ".join(settings.engine_urls),
        )
        try:
            yield
        finally:
            # uvicorn runs this after in-flight requests (streams included) have finished.
            await app.state.ingest.close()
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
    app.add_middleware(
        GatewayMiddleware,
        metrics=metrics,
        admission=Admission(settings.max_concurrency),
        retry_after_s=settings.retry_after_s,
    )
    return app
