"""Bodies of the OpenAI-compatible routes (/v1/chat/completions, /v1/completions, /v1/models),
plus the `rag` extension field that sets retrieval and blending per request."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from common.contract import (
    MAX_QUESTION_CHARS,
    AdditivePenalty,
    CacheSalt,
    ChunkOrder,
    Collections,
    DocIds,
    Hops,
    LogprobCount,
    Mode,
    Passages,
    Ratio,
    RecomputeRatio,
    RepetitionPenalty,
    RequestRetrievalName,
    ResponseFormat,
    Selection,
    StopString,
    TokenId,
    TopP,
    Usage,
    max_ratio_needs_auto,
)
from common.validation import Seed, Text
from gateway.api.schemas.logprobs import ChatLogprobs, CompletionLogprobs
from gateway.api.schemas.query import (
    CACHE_SALT_DESCRIPTION,
    CHUNK_ORDER_DESCRIPTION,
    DOCUMENTS_DESCRIPTION,
    HOPS_DESCRIPTION,
    MAX_RECOMPUTE_RATIO_DESCRIPTION,
    PENALTY_DESCRIPTION,
    RECOMPUTE_RATIO_DESCRIPTION,
    RESPONSE_FORMAT_DESCRIPTION,
    RETRIEVAL_DESCRIPTION,
    SAMPLING_DEFAULT_DESCRIPTION,
    SELECTION_DESCRIPTION,
    SourceOut,
)

MAX_MESSAGES = 256
MAX_CONTENT_PARTS = 64
MAX_PROMPTS = 16
# A prompt of token ids (lm-evaluation-harness sends them): the engine's max_model_len bounds
# it further.
MAX_PROMPT_TOKENS = 32_768
# OpenAI's own limit of stop sequences.
MAX_OPENAI_STOP = 4

MessageText = Annotated[Text, Field(max_length=MAX_QUESTION_CHARS)]


class RagOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    top_k: int | None = Field(None, ge=1)
    mode: Mode = Mode.CACHEBLEND
    recompute_ratio: RecomputeRatio | None = Field(None, description=RECOMPUTE_RATIO_DESCRIPTION)
    max_recompute_ratio: Ratio | None = Field(None, description=MAX_RECOMPUTE_RATIO_DESCRIPTION)
    selection: Selection | None = Field(None, description=SELECTION_DESCRIPTION)
    doc_ids: DocIds | None = None
    collections: Collections | None = Field(
        None, description="search only these (default: all the API key may use)"
    )
    retrieval: RequestRetrievalName | None = Field(None, description=RETRIEVAL_DESCRIPTION)
    hops: Hops | None = Field(None, description=HOPS_DESCRIPTION)
    chunk_order: ChunkOrder | None = Field(None, description=CHUNK_ORDER_DESCRIPTION)
    documents: Passages | None = Field(None, description=DOCUMENTS_DESCRIPTION)

    _max_ratio_needs_auto = model_validator(mode="after")(max_ratio_needs_auto)


class StreamOptions(BaseModel):
    include_usage: bool = False


class ContentPart(BaseModel):
    type: str = Field(max_length=64)
    text: MessageText | None = None


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: (
        MessageText | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None
    ) = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content if p.type == "text")
        return self.content or ""


# Fields that change nothing ragblend returns: accepted and ignored, as OpenAI's clients and
# frameworks send them.
IGNORED_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
        "safety_identifier",
        "prompt_cache_key",
    }
)
# Values of unsupported fields that ask for nothing (what a client sends by default).
_NOTHING_ASKED: tuple[object, ...] = (None, False, 0, "none", {}, [])


class _SamplingRequest(BaseModel):
    # Every other field is kept (extra="allow") so that `unsupported` can name it: a field
    # that would change the output, and that ragblend does not do, is a 400, not ignored.
    model_config = ConfigDict(extra="allow")

    model: Text | None = Field(None, max_length=200)
    max_tokens: int | None = Field(None, ge=1)
    # Unset: the engine's default (its setting, else the model's generation_config, else
    # greedy), as vLLM applies a model's generation_config; not OpenAI's 1.0, which a small
    # model turns into noise.
    temperature: float | None = Field(
        None, ge=0, le=2, allow_inf_nan=False, description=SAMPLING_DEFAULT_DESCRIPTION
    )
    top_p: TopP | None = Field(None, description=SAMPLING_DEFAULT_DESCRIPTION)
    n: int = Field(1, ge=1, description="one choice per request (more: a 400)")
    seed: Seed | None = None
    presence_penalty: AdditivePenalty | None = Field(None, description=PENALTY_DESCRIPTION)
    frequency_penalty: AdditivePenalty | None = Field(None, description=PENALTY_DESCRIPTION)
    # vLLM's extension of the OpenAI API.
    repetition_penalty: RepetitionPenalty | None = Field(None, description=PENALTY_DESCRIPTION)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_OPENAI_STOP)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = Field(None, description=RESPONSE_FORMAT_DESCRIPTION)
    # vLLM's extension, top-level as vLLM has it.
    cache_salt: CacheSalt | None = Field(None, description=CACHE_SALT_DESCRIPTION)
    rag: RagOptions = Field(default_factory=RagOptions)

    def unsupported(self) -> list[str]:
        """The fields of this request that would change the output and that ragblend does not
        support (tools, logit_bias, n > 1, any field it does not know), by name; empty when it
        asks only for what is supported."""
        named = [
            name
            for name, value in (self.model_extra or {}).items()
            if name not in IGNORED_FIELDS and not any(value == v for v in _NOTHING_ASKED)
        ]
        return (["n"] if self.n > 1 else []) + sorted(named)

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(
        False, description="each output token's log-probability (of the distribution sampled from)"
    )
    top_logprobs: LogprobCount | None = Field(
        None, description="the most likely tokens at each position, with logprobs true"
    )

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs true")
        return self

    @property
    def logprob_count(self) -> int | None:
        """Top alternatives the engine is asked for (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


PromptTokens = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]


class CompletionRequest(_SamplingRequest):
    # A text, token ids, or a list of either (one item: one choice per request).
    prompt: (
        MessageText
        | Annotated[list[MessageText], Field(max_length=MAX_PROMPTS)]
        | PromptTokens
        | Annotated[list[PromptTokens], Field(max_length=MAX_PROMPTS)]
    )
    max_tokens: int | None = Field(None, ge=1)
    logprobs: LogprobCount | None = Field(
        None,
        description="each token's log-probability (of the distribution sampled from) and this "
        "many most likely tokens at its position",
    )
    echo: bool = Field(
        False,
        description="the prompt before the completion, with logprobs its tokens' (the no-rag "
        "model only: the prompt as sent)",
    )

    def single_prompt(self) -> str | tuple[int, ...] | None:
        """The one prompt, text or token ids; None unless there is exactly one."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if prompt and isinstance(prompt[0], int):
            return tuple(prompt)  # type: ignore[arg-type]
        if len(prompt) != 1:
            return None
        only = prompt[0]
        return only if isinstance(only, str) else tuple(only)  # type: ignore[arg-type]

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class OpenAIUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, usage: Usage) -> OpenAIUsage:
        return cls(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            total_tokens=usage.prompt_tokens + usage.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
        )


class RagInfo(BaseModel):
    """The extension in responses: what was retrieved and how the prompt was built."""

    sources: list[SourceOut] = Field(description="the sources in the prompt, best first")
    dropped_sources: int = Field(description="retrieved sources left out so the prompt fit")
    dropped_turns: int = Field(
        0,
        description="earlier turns of the chat not sent: the oldest ones, so the prompt fit, "
        "and assistant messages before the first user message",
    )
    collections: list[str] | None = Field(description="the collections searched (None: all)")
    mode: Mode
    recomputed_tokens: int
    engine: str = Field(description="name of the engine that answered (engine-0, engine-1…)")
    timings: dict[str, Any]


class ChatChoice(BaseModel):
    index: int = 0
    message: dict[str, str]
    finish_reason: str
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: OpenAIUsage
    rag: RagInfo


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: OpenAIUsage
    rag: RagInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ragblend"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
