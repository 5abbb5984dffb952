"""Settings of the engine service: `RAGBLEND_ENGINE_*` environment variables or the CLI flags
derived from them (common.serving.add_settings_flags)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.auth import check_exposure
from common.contract import (
    MAX_ADDITIVE_PENALTY,
    MAX_PRECOMPUTE_CHUNKS,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MAX_TOKENS_LIMIT,
    RecomputeRatio,
    Selection,
)
from engine.blend.layout import DEFAULT_SYSTEM_PROMPT
from engine.types import DEFAULT_RECOMPUTE_RATIO, DecodeAttention, GenerationDefaults
from kvstore.codec import Encoding
from kvstore.eviction import PolicyName
from kvstore.remote_tier import check_url

GIB = 1024**3
MIB = 1024**2

# Selection's values, for the setting (a settings flag offers a Literal's values as choices);
# derived from the enum, which a type checker cannot follow: to it, a str.
if TYPE_CHECKING:
    SelectionName = str
else:
    SelectionName = Literal[tuple(s.value for s in Selection)]


class EngineSettings(BaseSettings):
    # hide_input_in_errors: an invalid setting is reported by name and reason, never with its
    # value, which may be a token or a Redis URL with a password.
    model_config = SettingsConfigDict(
        env_prefix="RAGBLEND_ENGINE_",
        protected_namespaces=(),
        populate_by_name=True,
        hide_input_in_errors=True,
    )

    model: str = Field(description="checkpoint directory or hub id in the local cache")
    device: Literal["cpu", "cuda"] = Field("cpu", description="torch device of the model")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights and KV dtype; auto: bfloat16 on cuda, float32 on the cpu"
    )
    host: str = Field("127.0.0.1", description="bind address")
    port: int = Field(8002, ge=1, le=65535, description="port the engine listens on")
    store_path: Path | None = Field(Path("data/kv"), description="directory of the SSD tier")
    memory_budget_gb: float = Field(
        2.0, ge=0, description="host-memory KV tier budget (evicts by kv_cache_policy)"
    )
    kv_cache_policy: PolicyName = Field(
        "tinylfu",
        description="eviction policy of the host-memory and gpu KV tiers: tinylfu (W-TinyLFU: "
        "one-off chunks cannot flush the warm ones) or lru; see docs/kvstore.md",
    )
    ssd_budget_gb: float = Field(20.0, ge=0, description="SSD KV tier budget (evicts by LRU)")
    kv_encoding: Encoding = Field(
        "int8",
        description="how new SSD and remote entries store KV: int8 or fp8 with per-channel "
        "scales (one byte per value, dequantized on the device) or none (as computed); see "
        "docs/kvstore.md",
    )
    lookahead: int = Field(2, ge=0, description="layers the KV loader runs ahead")
    remote_url: str | None = Field(
        None,
        repr=False,
        description="Redis of the remote KV tier every engine shares (redis://host:port/db or "
        "rediss://; a password is never logged); unset: no remote tier",
    )
    remote_timeout_s: float = Field(
        0.5,
        gt=0,
        le=30,
        description="connect and read timeout of one Redis operation; a failure makes the "
        "remote tier back off (1 s doubling to 30 s) and serve misses meanwhile",
    )
    gpu_tier_gb: float | None = Field(
        None,
        ge=0,
        description="device-memory KV tier on CUDA (0: none); unset: gpu_tier_share of the "
        "free GPU memory. On the CPU, host memory plays this role",
    )
    gpu_tier_share: float = Field(
        0.1, ge=0, le=0.5, description="share of the free GPU memory the gpu tier may use"
    )
    queue_depth: int = Field(
        16,
        ge=0,
        description="requests that may wait beyond those the free KV blocks admit; then 429",
    )
    max_background_chunks: int = Field(
        MAX_PRECOMPUTE_CHUNKS,
        ge=1,
        le=1_000_000,
        description="chunk computations (precompute, KV write-back) that may wait; then 429",
    )
    max_num_seqs: int = Field(
        16, ge=1, le=4096, description="sequences decoded together in one batch"
    )
    max_model_len: int | None = Field(
        None,
        ge=1,
        description="positions per sequence (prompt + max_tokens); unset: the model's, <= 8192",
    )
    kv_pool_gb: float | None = Field(
        None,
        gt=0,
        description="KV pool size; unset: half the free GPU memory or a quarter of the free RAM",
    )
    max_prefill_tokens: int = Field(
        8192,
        ge=1,
        le=1_048_576,
        description="prompt tokens admitted in one step (the first request always)",
    )
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        le=1_048_576,
        description="tokens one engine step feeds the model, decodes first (one each); "
        "prefills fill the rest and go on in the next step; unset: measured at start, as many "
        "prompt tokens as one decode step of one sequence takes on this machine (8 to 2048), "
        "each decoding sequence counting the prompt tokens it costs",
    )
    prefill_batch_tokens: int | None = Field(
        None,
        ge=0,
        le=1_048_576,
        description="prefills admitted together run side by side in one forward (projections "
        "and MLPs batched per layer) while their prompts total at most this many tokens; 0: "
        "one after another; unset: 2048 on the CPU, 16384 on a GPU",
    )
    cuda_graph_max_batch: int = Field(
        0,
        ge=0,
        le=64,
        description="replay decode steps of up to this many sequences from CUDA graphs, "
        "captured per batch and context bucket at first use (a GPU only; 0: eager)",
    )
    decode_attention: DecodeAttention = Field(
        "auto",
        description="how a decode step reads each sequence's KV blocks: per_row (the CPU's), "
        "batched (gathered; the GPU's), flex (flex_attention over the blocks in place; "
        "compiled on a GPU, not yet measured there) or auto: the device's",
    )
    cpu_prepacked_linear: bool = Field(
        True,
        description="float32 on the CPU: each linear layer's weight reordered once for oneDNN, "
        "so a decode batch reads it once (a second copy of those weights in memory)",
    )
    recompute_ratio: RecomputeRatio | None = Field(
        None,
        description="fixed ratio of requests that set none, or auto: the check layer keeps the "
        "tokens that cover auto_coverage of the selection's score mass, at most auto_max_ratio "
        "(docs/quality.md); unset: the controller chooses",
    )
    min_recompute_ratio: float = Field(
        DEFAULT_RECOMPUTE_RATIO, ge=0, le=1, description="the controller's lowest ratio"
    )
    check_layers: list[int] = Field(
        default_factory=list,
        description="check layers, e.g. 1 or 1,7 or 1,2,3; empty: layer 1 and a quarter of the "
        "model's depth (layer 1 alone below 8 layers)",
    )
    selection: SelectionName | None = Field(
        None,
        description="tokens cacheblend recomputes for requests that set no selection; unset: "
        "query_hkvd (half by the question's attention, half by KV deviation: the best "
        "measured) when the last check layer is deeper than the first, else hkvd (largest KV "
        "deviation, CacheBlend's); another of docs/quality.md#token-selection, or random of "
        "the same budget, a research baseline that serving should not use",
    )
    auto_coverage: float = Field(
        0.8,
        gt=0,
        le=1,
        description="share of the selection's score mass that recompute_ratio auto recomputes "
        "(0.8: with hkvd at layer 1, about r = 0.15 on average over real text)",
    )
    auto_max_ratio: float = Field(
        0.5,
        ge=0,
        le=1,
        description="the largest ratio recompute_ratio auto may choose (a request's "
        "max_recompute_ratio bounds its own)",
    )
    # Defaults of requests that leave a sampling field unset. Unset here: the model's
    # generation_config.json, else greedy decoding without penalties. `ragblend up` sets those
    # measured for the bundled model (docs/benchmarks/generation-defaults.md).
    temperature: float | None = Field(
        None,
        ge=0,
        le=MAX_TEMPERATURE,
        description="default temperature of requests (0: greedy); unset: the model's, else 0",
    )
    top_p: float | None = Field(
        None, gt=0, le=1, description="default top_p of requests; unset: the model's, else 1"
    )
    repetition_penalty: float | None = Field(
        None,
        gt=0,
        le=MAX_REPETITION_PENALTY,
        description="default repetition_penalty of requests (1: off; vLLM's meaning); unset: "
        "the model's, else 1",
    )
    frequency_penalty: float | None = Field(
        None,
        ge=-MAX_ADDITIVE_PENALTY,
        le=MAX_ADDITIVE_PENALTY,
        description="default frequency_penalty of requests (0: off; OpenAI's meaning)",
    )
    presence_penalty: float | None = Field(
        None,
        ge=-MAX_ADDITIVE_PENALTY,
        le=MAX_ADDITIVE_PENALTY,
        description="default presence_penalty of requests (0: off; OpenAI's meaning)",
    )
    max_tokens_limit: int = Field(MAX_TOKENS_LIMIT, ge=1, description="largest max_tokens accepted")
    system_prompt: str | None = Field(
        None,
        description="system prompt of requests that send none; unset: "
        f"{DEFAULT_SYSTEM_PROMPT!r} (the demo model, demo/, was trained with it)",
    )
    max_text_chars: int = Field(
        400_000, ge=1, description="longest question, system prompt or chunk text, in characters"
    )
    max_body_bytes: int = Field(16 * MIB, ge=1, description="largest request body; then 413")
    internal_token: str | None = Field(
        None,
        repr=False,
        min_length=1,
        # The engine's own variable, or the one every internal service shares.
        validation_alias=AliasChoices("RAGBLEND_ENGINE_INTERNAL_TOKEN", "RAGBLEND_INTERNAL_TOKEN"),
        description="bearer token every request but /health and /metrics must carry",
    )
    shadow_fraction: float = Field(
        0.0,
        ge=0,
        le=1,
        description="share of cacheblend and full_reuse requests checked against a full prefill "
        "of the same prompt, on idle time only (0: off); see docs/engine.md#shadow-checks",
    )
    shadow_max_tokens: int = Field(
        16, ge=1, le=256, description="greedy tokens a shadow check compares"
    )
    shadow_top_k: int = Field(5, ge=1, le=100, description="k of the shadow's top-k agreement")
    shadow_max_queue: int = Field(
        4, ge=1, le=64, description="shadow checks pending at most; more are skipped"
    )
    shadow_max_share: float = Field(
        0.1,
        gt=0,
        le=1,
        description="shadow compute at most this share of the wall time since start; more "
        "checks are skipped",
    )
    shadow_every_steps: int = Field(
        16,
        ge=0,
        le=100_000,
        description="under load, one piece of a shadow check after every this many engine "
        "steps (0: idle time only, and an arriving request drops the pending checks)",
    )
    shadow_kv_gb: float = Field(
        1.0,
        gt=0,
        le=1024,
        description="KV the pending shadow checks may hold (host copies of the blends' prompt "
        "KV and the running check's full-prefill KV on the device); more checks are skipped",
    )

    @field_validator("check_layers")
    @classmethod
    def _check_layers_not_negative(cls, value: list[int]) -> list[int]:
        if value and min(value) < 0:
            raise ValueError("check_layers are layer indices >= 0")
        return value

    @field_validator("remote_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        return check_url(value) if value else None  # an empty variable means none

    @model_validator(mode="after")
    def _token_beyond_loopback(self) -> EngineSettings:
        check_exposure("engine", self.host, self.internal_token)
        return self

    @property
    def generation_defaults(self) -> GenerationDefaults:
        return GenerationDefaults(
            self.temperature,
            self.top_p,
            self.presence_penalty,
            self.frequency_penalty,
            self.repetition_penalty,
        )

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype == "auto":
            return "bfloat16" if self.device == "cuda" else "float32"
        return self.dtype
