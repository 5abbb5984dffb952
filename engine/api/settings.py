"""Settings of the engine service: `RAGBLEND_ENGINE_*` environment variables or the CLI flags
derived from them (common.serving.add_settings_flags)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine.types import DEFAULT_RECOMPUTE_RATIO

GIB = 1024**3


class EngineSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RAGBLEND_ENGINE_", protected_namespaces=())

    model: str = Field(description="checkpoint directory or hub id in the local cache")
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    host: str = "127.0.0.1"
    port: int = Field(8002, ge=1, le=65535)
    store_path: Path | None = Field(Path("data/kv"), description="directory of the SSD tier")
    memory_budget_gb: float = Field(2.0, ge=0)
    ssd_budget_gb: float = Field(20.0, ge=0)
    lookahead: int = Field(2, ge=0, description="layers the KV loader runs ahead")
    queue_depth: int = Field(
        16, ge=0, description="requests that may wait beyond the free KV slots; then 429"
    )
    max_num_seqs: int = Field(
        16, ge=1, le=4096, description="sequences decoded together in one batch"
    )
    max_model_len: int | None = Field(
        None,
        ge=1,
        description="positions per sequence (prompt + max_tokens); default: the model's, <= 8192",
    )
    kv_pool_gb: float | None = Field(
        None,
        gt=0,
        description="KV pool size; default: half the free GPU memory or a quarter of the free RAM",
    )
    max_prefill_tokens: int = Field(
        8192,
        ge=1,
        le=1_048_576,
        description="prompt tokens admitted per prefill step (decodes run between)",
    )
    recompute_ratio: float | None = Field(
        None, ge=0, le=1, description="fixed ratio; None: the controller chooses"
    )
    min_recompute_ratio: float = Field(
        DEFAULT_RECOMPUTE_RATIO, ge=0, le=1, description="the controller's lowest ratio"
    )
    check_layers: list[int] = Field([1], description="check layers, e.g. 1 or 1,2,3")
    max_tokens_limit: int = Field(4096, ge=1, description="largest max_tokens accepted")
    system_prompt: str | None = None

    @field_validator("check_layers")
    @classmethod
    def _check_layers_not_empty(cls, value: list[int]) -> list[int]:
        if not value or min(value) < 0:
            raise ValueError("check_layers needs at least one layer index >= 0")
        return value

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype == "auto":
            return "bfloat16" if self.device == "cuda" else "float32"
        return self.dtype
