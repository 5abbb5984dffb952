"""The retriever's FastAPI app factory: loads the service at startup (in a thread), saves
the index in the background while running and once more at shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from common.auth import InternalTokenMiddleware
from common.body_limit import BodySizeLimitMiddleware
from common.errors import install_error_handlers
from common.request_id import RequestIdMiddleware
from common.requests import RequestGuardMiddleware
from retriever.api.routes import chunk, documents, health, search
from retriever.metrics import RetrieverMetrics
from retriever.service import RetrieverService
from retriever.settings import RetrieverSettings

logger = logging.getLogger(__name__)
DOCUMENTS_PATH = "/v1/documents"


async def _save_periodically(service: RetrieverService, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await run_in_threadpool(service.save_index)
        except OSError:
            logger.exception("saving the index failed; the catalog stays authoritative")


def create_app(settings: RetrieverSettings | None = None) -> FastAPI:
    settings = settings or RetrieverSettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service = await run_in_threadpool(RetrieverService.open, settings)
        app.state.service = service
        saver = None
        if settings.index_save_interval_s > 0:
            saver = asyncio.create_task(_save_periodically(service, settings.index_save_interval_s))
        logger.info("retriever ready: %s", service.stats())
        try:
            yield
        finally:
            if saver is not None:
                saver.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await saver
            # Reached after uvicorn's graceful wait: requests still embedding stop now, so
            # the worker threads (which the interpreter waits for) end within a few batches.
            service.stop_work()
            await run_in_threadpool(service.close)
            app.state.service = None

    app = FastAPI(title="ragblend retriever", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = RetrieverMetrics()
    app.state.service = None
    install_error_handlers(app)
    # The last added runs first: the request id is set before any refusal is logged, and a
    # request without the token is refused before its body is read or its type checked.
    app.add_middleware(RequestGuardMiddleware, multipart_paths={DOCUMENTS_PATH})
    app.add_middleware(
        BodySizeLimitMiddleware,
        max_bytes=settings.max_body_bytes,
        path_limits={DOCUMENTS_PATH: settings.max_upload_bytes},
    )
    app.add_middleware(InternalTokenMiddleware, token=settings.internal_token)
    app.add_middleware(RequestIdMiddleware)
    app.include_router(documents.router)
    app.include_router(search.router)
    app.include_router(chunk.router)
    app.include_router(health.router)
    return app
