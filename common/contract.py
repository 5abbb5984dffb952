"""The wire contract between the services, one definition for both sides of each call: the
enums, the limits and the bodies of the engine's /v1/generate and /v1/precompute and the
retriever's /v1/search."""

from __future__ import annotations

import json
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
# Top alternatives of a token's log-probability: OpenAI's bound of top_logprobs (and vLLM's).
MAX_LOGPROBS = 20
# Token ids of a raw prompt: the engine's max_model_len bounds them further.
MAX_PROMPT_TOKEN_IDS = 1_000_000
MAX_PRECOMPUTE_CHUNKS = 10_000
# A response_format's JSON schema, serialized (common.json_grammar.schema_text): bytes at most.
MAX_JSON_SCHEMA_BYTES = 64 * 1024
# Earlier turns of a conversation sent with its question (each turn's text is capped by the
# engine's max_text_chars, as the question is).
MAX_HISTORY_TURNS = 256
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


# Who said an earlier turn of a conversation (GenerateBody.history).
TurnRole = Literal["user", "assistant"]
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
LogprobCount = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
TokenId = Annotated[int, Field(ge=0)]
DocIds = Annotated[list[DocId], Field(min_length=1, max_length=MAX_DOC_IDS)]
Collections = Annotated[list[CollectionName], Field(min_length=1, max_length=MAX_COLLECTIONS)]
Hops = Annotated[int, Field(ge=1, le=MAX_HOPS)]


def not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be blank")
    return value


def history_error(roles: list[str]) -> str | None:
    """What is wrong with the roles of a history (user and assistant alternating, from a user
    turn to an assistant turn: the conversation every chat template accepts, the question the
    next user turn), None when nothing is."""
    for index, role in enumerate(roles):
        expected = "user" if index % 2 == 0 else "assistant"
        if role != expected:
            return (
                f"history.{index}.role is {role!r}, expected {expected!r}: turns alternate "
                "user, assistant, starting with a user turn"
            )
    if len(roles) % 2:
        return (
            "history ends with a user turn: it must end with the assistant's answer (the "
            "question is the next user turn)"
        )
    return None


def max_ratio_needs_auto(body: Any) -> Any:
    """A body's model validator (its fields recompute_ratio and max_recompute_ratio):
    max_recompute_ratio bounds recompute_ratio "auto" only."""
    if body.max_recompute_ratio is not None and body.recompute_ratio != AUTO_RATIO:
        raise ValueError(
            f"max_recompute_ratio bounds recompute_ratio {AUTO_RATIO!r} only; "
            f"got recompute_ratio {body.recompute_ratio!r}"
        )
    return body


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the schema the output must validate against.
    It is always enforced (the tokens are masked to it), `strict` or not."""

    # `schema` by its wire name, whichever side dumps the body.
    model_config = ConfigDict(extra="forbid", serialize_by_alias=True, validate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Text | None = Field(None, max_length=MAX_QUESTION_CHARS)
    # The field is not called `schema`: that name shadows a pydantic BaseModel attribute.
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON valid against a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        schema = self.schema_text()
        if schema is not None and len(schema.encode()) > MAX_JSON_SCHEMA_BYTES:
            raise ValueError(
                f"json_schema.schema: {len(schema.encode())} bytes serialized, above the "
                f"limit of {MAX_JSON_SCHEMA_BYTES}"
            )
        return self

    def schema_text(self) -> str | None:
        """The JSON schema the output must validate against, serialized canonically; None for
        free text. json_object asks for any JSON object: the schema {"type": "object"}."""
        if self.type == "text":
            return None
        schema = {"type": "object"} if self.json_schema is None else self.json_schema.json_schema
        return json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


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


class TurnIn(BaseModel):
    """One earlier turn of a conversation: what the user asked, or what the assistant answered."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: TurnRole
    # Capped by the engine's max_text_chars setting, checked at its route.
    text: Text = Field(min_length=1)


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
    # Unused with prompt_token_ids (then it may be empty).
    question: Text = ""
    # The conversation before the question, oldest first: user and assistant alternating, from
    # a user turn to an assistant turn. Rendered by the model's chat template after the
    # passages (the prompt's suffix); fit_context drops the oldest turns first.
    history: list[TurnIn] = Field(default_factory=list, max_length=MAX_HISTORY_TURNS)
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
    # Drop the oldest turns of history, then chunks from the end (the worst), until the prompt
    # fits the model (docs/engine.md, "Prompt layout").
    fit_context: bool = False
    # The chunks come best first; best_last lays them out reversed, the best next to the question.
    chunk_order: ChunkOrderField = ChunkOrder.BEST_FIRST
    # The prompt as it is (no template, system text or chunks): the question's text, or
    # these token ids (each below the model's vocabulary size, checked by the engine).
    raw_prompt: bool = False
    prompt_token_ids: Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKEN_IDS)] | None = None
    # Log-probabilities with this many top alternatives: of each generated token, under the
    # distribution it was sampled from; of each prompt token (mode full_prefill only).
    logprobs: LogprobCount | None = None
    prompt_logprobs: LogprobCount | None = None
    # None or type text: free text; else the tokens are masked to JSON (docs/engine.md).
    response_format: ResponseFormat | None = None
    # The scope of the prompt prefix's cached KV (system prompt, template start); each chunk
    # carries its own.
    cache_salt: CacheSalt = ""

    _max_ratio_needs_auto = model_validator(mode="after")(max_ratio_needs_auto)

    @model_validator(mode="after")
    def _has_prompt(self) -> GenerateBody:
        if self.prompt_token_ids is None and not self.question:
            raise ValueError("question must not be empty (or prompt_token_ids given)")
        return self

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else (self.stop or [])

    def texts(self) -> list[tuple[str, str]]:
        """(field name, text) of every free text, for the length limit."""
        named = [("question", self.question), ("system", self.system or "")]
        named += [(f"history.{i}.text", t.text) for i, t in enumerate(self.history)]
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


class TopLogprob(BaseModel):
    token_id: int
    token: str  # the token decoded on its own
    logprob: float


class TokenLogprob(BaseModel):
    """A token's log-probability (None: a prompt's first token, which nothing predicts) and the
    most likely tokens at its position, most likely first."""

    token_id: int
    token: str
    logprob: float | None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class GenerateResponse(BaseModel):
    """The engine's answer: the JSON body, or the data of the stream's `event: result`."""

    text: str
    finish_reason: str
    usage: Usage
    timings: Timings
    blend: Blend
    chunk_tiers: list[str | None]
    dropped_chunks: int  # dropped from the end by fit_context; 0 without it
    # When asked: each generated token's (an EOS that ended it included); each prompt token's.
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    dropped_turns: int  # turns of history dropped, the oldest first, by fit_context


class Delta(BaseModel):
    """The data of one `event: delta` of a generation's stream: text, and when asked the
    log-probability of the token that gave it (its text may come in a later delta), or once,
    before the first token, those of the prompt."""

    text: str
    logprobs: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


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
