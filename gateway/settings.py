"""Settings of the gateway service: `RAGBLEND_GATEWAY_*` environment variables or the CLI flags
derived from them, validated when the class is built."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from common.contract import MAX_TOKENS_LIMIT, ChunkOrderName
from gateway.auth import load_keys
from gateway.tenancy import CacheSharing


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RAGBLEND_GATEWAY_", extra="ignore")

    host: str = Field("127.0.0.1", description="bind address")
    port: int = Field(8000, ge=1, le=65535, description="port the gateway listens on")
    retriever_url: str = Field("http://127.0.0.1:8001", description="the retriever's URL")
    # NoDecode: the env var may be a comma-separated list as well as JSON.
    engine_urls: Annotated[list[str], NoDecode] = Field(
        ["http://127.0.0.1:8002"], description="engine URLs (rendezvous-hashed by chunk set)"
    )
    max_concurrency: int = Field(64, ge=1, description="queries in flight; beyond: 429")
    retry_after_s: int = Field(1, ge=1, description="Retry-After sent with a 429")
    connect_timeout_s: float = Field(2.0, gt=0, description="connecting to any dependency")
    retrieval_timeout_s: float = Field(
        10.0, gt=0, description="the longest a request waits on the retriever, retries included"
    )
    ingest_timeout_s: float = Field(600.0, gt=0, description="retriever ingest of one document")
    precompute_timeout_s: float = Field(
        600.0, gt=0, description="one engine precompute call (an ingested document's chunks)"
    )
    generate_timeout_s: float = Field(
        300.0, gt=0, description="longest wait between two events of an engine's stream"
    )
    ttft_timeout_s: float = Field(
        10.0, gt=0, description="first engine event deadline (plus its queue estimate)"
    )
    health_interval_s: float = Field(2.0, gt=0, description="engine health poll period")
    health_timeout_s: float = Field(1.0, gt=0, description="one health probe")
    retries: int = Field(2, ge=0, description="extra tries of idempotent calls")
    retry_backoff_s: float = Field(0.2, ge=0, description="first backoff; doubles per try")
    default_top_k: int = Field(
        4, ge=1, description="chunks retrieved when a request gives no top_k"
    )
    default_hops: int = Field(
        1, ge=1, le=2, description="retrieval hops when a request gives none (2: multi-hop)"
    )
    chunk_order: ChunkOrderName = Field(
        "best_last",
        description="where the best chunk goes when a request gives no chunk_order: best_first "
        "(first in the prompt) or best_last (next to the question)",
    )
    max_top_k: int = Field(32, ge=1, description="largest top_k accepted")
    default_max_tokens: int = Field(
        128, ge=1, description="answer length when a request gives no max_tokens"
    )
    max_tokens_limit: int = Field(MAX_TOKENS_LIMIT, ge=1, description="largest max_tokens accepted")
    model_name: str = Field("ragblend", description="model id shown by /v1/models")
    no_rag_model_name: str | None = Field(
        None,
        min_length=1,
        description="second model id of /v1/models: the model without retrieval, the prompt "
        "sent as it is; unset: model_name + '-no-rag'",
    )
    shutdown_grace_s: float = Field(30.0, ge=0, description="drain time for in-flight streams")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="request body limit")
    max_upload_bytes: int = Field(50 << 20, ge=1024, description="POST /v1/documents body limit")
    api_keys: Annotated[list[str], NoDecode] = Field(
        [], repr=False, description="API keys allowed every collection"
    )
    api_keys_file: Path | None = Field(
        None, description='JSON [{"name", "key" or "sha256", "collections"}]'
    )
    internal_token: str | None = Field(
        None, repr=False, description="bearer token sent to the retriever and the engines"
    )
    cors_origins: Annotated[list[str], NoDecode] = Field(
        [], description="browser origins allowed to call the API (none: CORS off)"
    )
    cache_sharing: CacheSharing = Field(
        "per_key",
        description="with API keys, whose cached KV a request may reuse: per_key (each key's "
        "passages apart, each collection's chunks for the keys allowed it), per_collections "
        "(keys allowed the same collections share passages) or shared (everyone shares)",
    )
    passage_separator: str | None = Field(
        None,
        min_length=1,
        max_length=64,
        description="LMCache's convention, opt-in: a plain prompt (or chat's last user message) "
        "holding this string is split on it into system prompt, passages and question",
    )

    @property
    def keyed(self) -> bool:
        return bool(self.api_keys) or self.api_keys_file is not None

    @property
    def no_rag_model(self) -> str:
        """The model id that serves the model without retrieval."""
        return self.no_rag_model_name or f"{self.model_name}-no-rag"

    @field_validator("retriever_url")
    @classmethod
    def _strip_slash(cls, value: str) -> str:
        return value.rstrip("/")

    @field_validator("engine_urls", "api_keys", "cors_origins", mode="before")
    @classmethod
    def _split_list(cls, value: object) -> object:
        # A comma-separated string (a CLI flag or an env var) or a JSON list.
        if isinstance(value, str):
            if value.lstrip().startswith("["):
                return json.loads(value)
            return [part for part in (p.strip() for p in value.split(",")) if part]
        return value

    @field_validator("engine_urls")
    @classmethod
    def _engines_not_empty(cls, value: list[str]) -> list[str]:
        urls = [url.rstrip("/") for url in value]
        if not urls:
            raise ValueError("engine_urls needs at least one engine URL")
        if len(set(urls)) != len(urls):
            raise ValueError("engine_urls lists an engine twice")
        return urls

    @model_validator(mode="after")
    def _default_within_max(self) -> GatewaySettings:
        if self.default_top_k > self.max_top_k:
            raise ValueError("default_top_k must not exceed max_top_k")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("default_max_tokens must not exceed max_tokens_limit")
        load_keys(self.api_keys, self.api_keys_file)  # a bad key file fails at startup
        return self
