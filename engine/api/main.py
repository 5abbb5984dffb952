"""The engine service app: loads the model and the KV store at startup, serves the routes."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from common.errors import install_error_handlers
from common.request_id import RequestIdMiddleware
from engine.api.metrics import EngineMetrics
from engine.api.routes import generate, health, precompute
from engine.api.settings import GIB, EngineSettings
from engine.engine import Engine
from engine.model import load_model
from kvstore.store import KVStore, KVStoreConfig

log = logging.getLogger(__name__)


def build_engine(settings: EngineSettings) -> Engine:
    loaded = load_model(settings.model, device=settings.device, dtype=settings.torch_dtype_name)
    store = KVStore(
        KVStoreConfig(
            model_fingerprint=loaded.fingerprint,
            memory_budget_bytes=int(settings.memory_budget_gb * GIB),
            ssd_path=settings.store_path,
            ssd_budget_bytes=int(settings.ssd_budget_gb * GIB),
            pin_memory=settings.device == "cuda",
            lookahead=settings.lookahead,
        )
    )
    return Engine(
        loaded,
        store,
        check_layers=tuple(settings.check_layers),
        recompute_ratio=settings.recompute_ratio,
        min_recompute_ratio=settings.min_recompute_ratio,
        system_prompt=settings.system_prompt,
        max_waiting=settings.queue_depth,
        max_num_seqs=settings.max_num_seqs,
        max_model_len=settings.max_model_len,
        kv_pool_bytes=None if settings.kv_pool_gb is None else int(settings.kv_pool_gb * GIB),
        max_prefill_tokens=settings.max_prefill_tokens,
    )


def create_app(settings: EngineSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine = await asyncio.to_thread(build_engine, settings)
        app.state.engine = engine
        app.state.metrics = EngineMetrics(engine)
        log.info("engine ready: %s on %s", settings.model, settings.device)
        try:
            yield
        finally:
            await asyncio.to_thread(engine.close)
            await asyncio.to_thread(engine.store.close)

    app = FastAPI(title="ragblend engine", lifespan=lifespan)
    app.state.settings = settings
    app.state.engine = None

    install_error_handlers(app)
    app.add_middleware(RequestIdMiddleware)
    app.include_router(generate.router)
    app.include_router(precompute.router)
    app.include_router(health.router)
    return app
