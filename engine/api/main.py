"""The engine service app: loads the model and the KV store at startup, serves the routes."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from common.auth import InternalTokenMiddleware
from common.body_limit import BodySizeLimitMiddleware
from common.errors import error_response, install_error_handlers
from common.request_id import RequestIdMiddleware
from common.requests import RequestGuardMiddleware
from engine.api.metrics import EngineMetrics
from engine.api.routes import generate, health, precompute
from engine.api.settings import GIB, EngineSettings
from engine.blend.selection import Selection
from engine.engine import Engine
from engine.model.load import load_model
from engine.quality.shadow import ShadowConfig
from kvstore import tiers
from kvstore.remote_tier import RemoteTier
from kvstore.store import KVStore, KVStoreConfig

log = logging.getLogger(__name__)


def gpu_tier_bytes(settings: EngineSettings) -> int:
    """The gpu tier's budget: the setting, or a share of the device memory free now (after
    the model, before the KV pool takes half of what is left)."""
    if settings.device != "cuda":
        return 0
    if settings.gpu_tier_gb is not None:
        return int(settings.gpu_tier_gb * GIB)
    free, _ = torch.cuda.mem_get_info()
    return int(free * settings.gpu_tier_share)


def kv_store_config(settings: EngineSettings, fingerprint: str, device: str) -> KVStoreConfig:
    """The KV store's configuration from the settings, for the model loaded on `device`."""
    return KVStoreConfig(
        model_fingerprint=fingerprint,
        memory_budget_bytes=int(settings.memory_budget_gb * GIB),
        ssd_path=settings.store_path,
        ssd_budget_bytes=int(settings.ssd_budget_gb * GIB),
        pin_memory=settings.device == "cuda",
        lookahead=settings.lookahead,
        gpu_budget_bytes=gpu_tier_bytes(settings),
        device=device,
        persistent_encoding=settings.kv_encoding,
        remote_url=settings.remote_url,
        remote_timeout_s=settings.remote_timeout_s,
        memory_policy=settings.kv_cache_policy,
    )


def build_engine(settings: EngineSettings) -> Engine:
    loaded = load_model(settings.model, device=settings.device, dtype=settings.torch_dtype_name)
    store = KVStore(kv_store_config(settings, loaded.fingerprint, str(loaded.device)))
    remote = store.tier(tiers.REMOTE)
    if isinstance(remote, RemoteTier):
        # A Redis down now does not stop the engine: the tier says unreachable and retries.
        up = remote.ping()
        log.info("remote KV tier %s: %s", remote.url, "ok" if up else remote.last_error)
    return Engine(
        loaded,
        store,
        check_layers=tuple(settings.check_layers),
        selection=Selection(settings.selection) if settings.selection else None,
        recompute_ratio=settings.recompute_ratio,
        min_recompute_ratio=settings.min_recompute_ratio,
        auto_coverage=settings.auto_coverage,
        auto_max_ratio=settings.auto_max_ratio,
        system_prompt=settings.system_prompt,
        max_waiting=settings.queue_depth,
        max_background_chunks=settings.max_background_chunks,
        max_num_seqs=settings.max_num_seqs,
        max_model_len=settings.max_model_len,
        kv_pool_bytes=None if settings.kv_pool_gb is None else int(settings.kv_pool_gb * GIB),
        max_prefill_tokens=settings.max_prefill_tokens,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        prefill_batch_tokens=settings.prefill_batch_tokens,
        cuda_graph_max_batch=settings.cuda_graph_max_batch,
        decode_attention=settings.decode_attention,
        cpu_prepacked_linear=settings.cpu_prepacked_linear,
        generation_defaults=settings.generation_defaults,
        shadow=ShadowConfig(
            fraction=settings.shadow_fraction,
            max_tokens=settings.shadow_max_tokens,
            top_k=settings.shadow_top_k,
            max_queue=settings.shadow_max_queue,
            max_share=settings.shadow_max_share,
            every_steps=settings.shadow_every_steps,
            max_kv_bytes=int(settings.shadow_kv_gb * GIB),
        ),
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

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Runs outside the request-id middleware; the message may hold internal paths, so it
        # goes to the log only.
        log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, "internal error (see the engine log)")

    # The last added runs first: the request id, then the token, the guard and the size limit.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestGuardMiddleware)
    app.add_middleware(InternalTokenMiddleware, token=settings.internal_token)
    app.add_middleware(RequestIdMiddleware)
    app.include_router(generate.router)
    app.include_router(precompute.router)
    app.include_router(health.router)
    return app
