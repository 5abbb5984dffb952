"""GET /health and GET /metrics of the engine service."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.api.deps import EngineDep, MetricsDep
from engine.api.schemas import error_responses
from kvstore import tiers
from kvstore.remote_tier import RemoteTier
from kvstore.types import TierStats

router = APIRouter()


def _state(tier: TierStats, write_error: str | None) -> str:
    if not tier.reachable:
        return "unreachable"
    return "ok" if write_error is None else "write_failing"


@router.get("/health", responses=error_responses(500, 503))
async def health(engine: EngineDep) -> dict:
    """Reads counters only (the engine lock is never held while the model runs), so it
    answers while the worker is busy. An unreachable remote tier is pinged (once its back-off
    is over), so its state comes back to ok when Redis does, even with no traffic."""
    remote = engine.store.tier(tiers.REMOTE)
    if isinstance(remote, RemoteTier) and not remote.reachable:
        await asyncio.to_thread(remote.ping)
    stats = engine.store.stats()
    store: dict[str, dict | None] = {name: None for name in tiers.ORDER}
    for name, tier in stats.tiers.items():
        entry: dict = {"entries": tier.entries, "bytes": tier.bytes}
        write_error = stats.last_write_error_by_tier.get(name)
        if name == tiers.REMOTE:
            entry["state"] = _state(tier, write_error)
            entry["last_error"] = tier.last_error or write_error
            entry["hits"], entry["misses"] = tier.hits, tier.misses
        elif name in tiers.PERSISTENT:
            entry["state"] = _state(tier, write_error)
            entry["last_write_error"] = write_error
        store[name] = entry
    return {
        "status": "ok",
        "model": engine.model_name,
        "fingerprint": engine.fingerprint,
        "device": str(engine.device),
        "dtype": str(engine.loaded.dtype).removeprefix("torch."),
        "max_model_len": engine.max_model_len,
        "requests_running": engine.num_running,
        "requests_waiting": engine.num_waiting,
        "queue_estimate_s": round(engine.queue_estimate_s(), 3),
        # Lets the gateway give a long prompt's own prefill time before its first token.
        "prefill_tokens_per_s": engine.estimate.prefill_tokens_per_s,
        "kv_write_failures": stats.write_errors,
        "store": store,
        # With a shared tier, a chunk precomputed by one engine serves every engine.
        "shared_kv": remote is not None,
    }


@router.get(
    "/metrics",
    responses={
        200: {"content": {"text/plain": {}}, "description": "Prometheus text format"},
        **error_responses(500),
    },
)
async def metrics(metrics: MetricsDep) -> Response:
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
