"""Settings of the engine service: `RAGBLEND_ENGINE_*` environment variables or CLI flags."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

GIB = 1024**3


class EngineSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RAGBLEND_ENGINE_", protected_namespaces=())

    model: str = Field(description="checkpoint directory or hub id in the local cache")
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    host: str = "127.0.0.1"
    port: int = Field(8002, ge=1, le=65535)
    store_path: Path | None = Path("data/kv")
    memory_budget_gb: float = Field(2.0, ge=0)
    ssd_budget_gb: float = Field(20.0, ge=0)
    lookahead: int = Field(2, ge=0)
    queue_depth: int = Field(16, ge=1, description="generations that may wait; beyond: 429")
    recompute_ratio: float | None = Field(None, ge=0, le=1, description="None: the controller")
    min_recompute_ratio: float = Field(0.15, ge=0, le=1)
    check_layers: list[int] = [1]
    max_tokens_limit: int = Field(4096, ge=1)
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
