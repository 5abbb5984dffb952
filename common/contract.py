"""The wire contract between the services, one definition for both sides of each call: the
enums, the limits and the bodies of the engine's /v1/generate and /v1/precompute and the
retriever's /v1/search."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

from common.validation import CollectionName, DocId, Seed, Text

# A question (gateway), the query it becomes (retriever): characters.
MAX_QUESTION_CHARS = 100_000
# Stop strings of one generation, as the gateway takes them and the engine matches them.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
# Filters of a search, passed on by the gateway to the retriever.
MAX_DOC_IDS = 1_000
MAX_COLLECTIONS = 64
# Retrieval hops of a search (the second follows the names the first chunks mention).
MAX_HOPS = 2
# The bound of the retriever's max_top_k setting; the setting itself is checked in its route.
MAX_TOP_K = 10_000
# OpenAI's bound of presence_penalty and frequency_penalty; vLLM's repetition_penalty (1: off).
MAX_ADDITIVE_PENALTY = 2.0
MAX_REPETITION_PENALTY = 2.0
MAX_TEMPERATURE = 10.0
# The default of the gateway's and the engine's max_tokens_limit setting.
MAX_TOKENS_LIMIT = 4096
MAX_CHUNK_ID_CHARS = 256
# Passages an application sends with a request (an OpenAI body's rag.documents, /v1/query's
# documents): how many, and the characters of one (it is chunked like an ingested document).
MAX_PASSAGES = 64
MAX_PASSAGE_CHARS = 50_000
# A request's cache_salt (vLLM's field), and the salt of a chunk or a prompt on the wire to the
# engine (the gateway sends a hash: 64 hex characters).
MAX_CACHE_SALT_CHARS = 256
# The retriever's /v1/chunk: texts of one call.
MAX_CHUNK_TEXTS = MAX_PASSAGES
MAX_GENERATE_CHUNKS = 1_000
MAX_PRECOMPUTE_CHUNKS = 10_000
# A streamed /v1/generate's response header: the engine's estimate of the seconds the request
# waits before its prefill starts, taken as it was queued (the gateway's first-event deadline).
QUEUE_ESTIMATE_HEADER = "X-Queue-Estimate"


# The recompute_ratio that lets the check layer choose r by quality (docs/quality.md).
AUTO_RATIO = "auto"


class Mode(StrEnum):
    CACHEBLEND = "cacheblend"
    FULL_PREFILL = "full_prefill"
    PREFIX_CACHE = "prefix_cache"
    FULL_REUSE = "full_reuse"


class Selection(StrEnum):
    """How cacheblend's check layers pick the chunk tokens to recompute (docs/quality.md,
    "Token selection"): each is a pure function in engine/selection.py."""

    HKVD = "hkvd"  # the largest KV deviation from the cached KV (CacheBlend)
    RANDOM = "random"  # a seeded random pick of the same budget: a baseline, not for serving
    SINK = "sink"  # the first tokens of each chunk (EPIC's LegoLink: each chunk's sink)
    QUERY = "query"  # the tokens the question's queries attend to most
    QUERY_HKVD = "query_hkvd"  # half the budget by the question's attention, half by HKVD
    SINK_HKVD = "sink_hkvd"  # a few first tokens of each chunk, the rest by HKVD
    WEIGHTED = "weighted"  # KV deviation weighted by the question's attention


class ChunkOrder(StrEnum):
    """Where a request's chunks (sent best first) go in the prompt: in the order sent, or
    reversed so that the best one is next to the question."""

    BEST_FIRST = "best_first"
    BEST_LAST = "best_last"


# ChunkOrder's values, for a setting (a settings flag offers a Literal's values as choices).
ChunkOrderName = Literal["best_first", "best_last"]
# The retriever's search modes (docs/retriever.md, "Hybrid retrieval"); None: its default.
RetrievalName = Literal["dense", "bm25", "hybrid"]
# A generating request's retrieval: a search mode, or "none" (no search: its own passages only).
NO_RETRIEVAL = "none"
RequestRetrievalName = RetrievalName | Literal["none"]

# Enums by value even in strict bodies (JSON has no enum instances).
ModeField = Annotated[Mode, Strict(False)]
SelectionField = Annotated[Selection, Strict(False)]
ChunkOrderField = Annotated[ChunkOrder, Strict(False)]
StopString = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stops = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
Ratio = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
# A request's recompute_ratio: a fixed ratio, or AUTO_RATIO (the check layer chooses it).
RecomputeRatio = Ratio | Literal["auto"]
Temperature = Annotated[float, Field(ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
AdditivePenalty = Annotated[
    float, Field(ge=-MAX_ADDITIVE_PENALTY, le=MAX_ADDITIVE_PENALTY, allow_inf_nan=False)
]
RepetitionPenalty = Annotated[float, Field(gt=0, le=MAX_REPETITION_PENALTY, allow_inf_nan=False)]
DocIds = Annotated[list[DocId], Field(min_length=1, max_length=MAX_DOC_IDS)]
Collections = Annotated[list[CollectionName], Field(min_length=1, max_length=MAX_COLLECTIONS)]
Hops = Annotated[int, Field(ge=1, le=MAX_HOPS)]


def not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be blank")
    return value


def max_ratio_needs_auto(body: Any) -> Any:
    """A body's model validator (its fields recompute_ratio and max_recompute_ratio):
    max_recompute_ratio bounds recompute_ratio "auto" only."""
    if body.max_recompute_ratio is not None and body.recompute_ratio != AUTO_RATIO:
        raise ValueError(
            f"max_recompute_ratio bounds recompute_ratio {AUTO_RATIO!r} only; "
            f"got recompute_ratio {body.recompute_ratio!r}"
        )
    return body


CacheSalt = Annotated[Text, Field(max_length=MAX_CACHE_SALT_CHARS)]


class Passage(BaseModel):
    """A passage an application sends with its request, chunked like an ingested document and
    blended like a retrieved chunk."""

    model_config = ConfigDict(extra="forbid")

    id: Text | None = Field(
        None,
        min_length=1,
        max_length=MAX_CHUNK_ID_CHARS,
        description="its doc_id in the response's sources; default: passage-<its index>",
    )
    text: Text = Field(min_length=1, max_length=MAX_PASSAGE_CHARS)

    _text_not_blank = field_validator("text")(not_blank)


Passages = Annotated[list[Passage], Field(min_length=1, max_length=MAX_PASSAGES)]


class ChunkIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # "0" is not 0, nor 0 False

    id: Text = Field(min_length=1, max_length=MAX_CHUNK_ID_CHARS)
    # Capped by the engine's max_text_chars setting, checked at its route.
    text: Text = Field(min_length=1)
    # The scope of the chunk's KV (kvstore.types.chunk_key): stored and found under this salt
    # only, so that a tenant's KV never answers another tenant's lookup; "": unscoped.
    cache_salt: CacheSalt = ""


class PrecomputeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    chunks: list[ChunkIn] = Field(max_length=MAX_PRECOMPUTE_CHUNKS)


class PrecomputeResponse(BaseModel):
    stored: int  # entries written to the store's last tier (SSD, else memory)
    skipped: int  # already stored
    failed: int  # computed but not written (e.g. the disk is full): memory-only at best
    bytes: int


class GenerateBody(BaseModel):
    """The body of the engine's /v1/generate; the gateway sends it, the engine validates it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    # question, system and chunk texts: capped by the engine's max_text_chars at its route.
    system: Text | None = None
    chunks: list[ChunkIn] = Field(default_factory=list, max_length=MAX_GENERATE_CHUNKS)
    question: Text = Field(min_length=1)
    mode: ModeField = Mode.CACHEBLEND
    # None: the engine's recompute_ratio and selection settings; max_recompute_ratio bounds
    # "auto" only (None: the engine's auto_max_ratio).
    recompute_ratio: RecomputeRatio | None = None
    max_recompute_ratio: Ratio | None = None
    selection: SelectionField | None = None
    max_tokens: int = Field(64, ge=1)
    # None: the engine's default (its settings, else the model's generation_config, else greedy
    # decoding without penalties).
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    presence_penalty: AdditivePenalty | None = None
    frequency_penalty: AdditivePenalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    stop: Stops | StopString | None = None
    ignore_eos: bool = False
    stream: bool = False
    # Drop chunks from the end (the worst) until the prompt fits the model.
    fit_context: bool = False
    # The chunks come best first; best_last lays them out reversed, the best next to the question.
    chunk_order: ChunkOrderField = ChunkOrder.BEST_FIRST
    # The scope of the prompt prefix's cached KV (system prompt, template start); each chunk
    # carries its own.
    cache_salt: CacheSalt = ""

    _max_ratio_needs_auto = model_validator(mode="after")(max_ratio_needs_auto)

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else (self.stop or [])

    def texts(self) -> list[tuple[str, str]]:
        """(field name, text) of every free text, for the length limit."""
        named = [("question", self.question), ("system", self.system or "")]
        return named + [(f"chunks.{i}.text", c.text) for i, c in enumerate(self.chunks)]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    recomputed_tokens: int


class LayerTimings(BaseModel):
    layer: int
    load_start_s: float | None
    load_end_s: float | None
    compute_start_s: float
    compute_end_s: float


class Timings(BaseModel):
    ttft_s: float
    queue_s: float
    prefill_s: float
    kv_load_s: float
    kv_wait_s: float
    recompute_s: float
    decode_s: float
    total_s: float
    overlap: float
    layers: list[LayerTimings]


class Blend(BaseModel):
    recompute_ratio: float  # with "auto": the ratio the check layer chose
    leading_layers: int
    chosen_by: str  # request, engine, controller or auto
    fell_back_to_full_prefill: bool
    selection: str  # a Selection's value ("oracle" in research runs)


class GenerateResponse(BaseModel):
    """The engine's answer: the JSON body, or the data of the stream's `event: result`."""

    text: str
    finish_reason: str
    usage: Usage
    timings: Timings
    blend: Blend
    chunk_tiers: list[str | None]
    dropped_chunks: int  # dropped from the end by fit_context; 0 without it


class Delta(BaseModel):
    """The data of one `event: delta` of a generation's stream."""

    text: str


class SearchRequest(BaseModel):
    query: Text = Field(max_length=MAX_QUESTION_CHARS, description="truncated to the model window")
    # The upper bound is a runtime setting (max_top_k), checked in the route.
    top_k: int = Field(default=5, gt=0, le=MAX_TOP_K)
    doc_ids: DocIds | None = None
    min_score: float | None = Field(
        default=None,
        ge=-1.0,
        le=1.0,
        allow_inf_nan=False,
        description="least cosine similarity of a result (dense and hybrid only)",
    )
    collections: Collections | None = Field(
        default=None, description="collections to search; None: all"
    )
    retrieval: RetrievalName | None = Field(
        default=None,
        description="dense (embeddings), bm25 (full text) or hybrid (both, rank-fused); "
        "None: the retriever's `retrieval` setting",
    )
    hops: Hops = Field(
        default=1,
        description="2: up to top_k more chunks found by the names the first ones mention",
    )

    @field_validator("query")
    @classmethod
    def _query_not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("query is empty")
        return value


class SearchResult(BaseModel):
    chunk_id: str
    collection: str
    doc_id: str
    score: float = Field(
        description="dense: cosine similarity; bm25: -BM25 (higher is better); hybrid: "
        "reciprocal rank fusion score"
    )
    text: str
    num_tokens: int
    hop: int = Field(description="1: found by the query; 2: by a name in a first-hop chunk")


class SearchResponse(BaseModel):
    results: list[SearchResult]


class ChunkTextsRequest(BaseModel):
    """The retriever's /v1/chunk: texts to split as an ingested document is split."""

    texts: list[Annotated[Text, Field(min_length=1, max_length=MAX_PASSAGE_CHARS)]] = Field(
        min_length=1, max_length=MAX_CHUNK_TEXTS
    )


class TextChunk(BaseModel):
    chunk_id: str = Field(description="a hash of its text, as an ingested chunk's")
    text: str
    num_tokens: int


class ChunkTextsResponse(BaseModel):
    chunks: list[list[TextChunk]] = Field(description="per text, its chunks in order")
