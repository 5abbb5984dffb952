"""Typed requests and results of the engine's Python API.

The engine service converts its pydantic schemas into these; the engine never sees HTTP.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal, TypeVar

from common.contract import (
    AUTO_RATIO,
    MAX_ADDITIVE_PENALTY,
    MAX_HISTORY_TURNS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    ChunkOrder,
    Mode,
    Selection,
    TurnRole,
    history_error,
)
from engine.errors import InvalidRequestError

_E = TypeVar("_E", bound=StrEnum)

# Positions per KV block of the paged pool (the runner's tensors, the scheduler's counts).
DEFAULT_BLOCK_SIZE = 16


def _is_ratio(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0.0 <= value <= 1.0
    )


def _parse_enum(enum: type[_E], value: str | _E, field: str) -> _E:
    try:
        return enum(value)
    except ValueError:
        expected = ", ".join(m.value for m in enum)
        raise InvalidRequestError(
            f"unknown {field} {value!r}; expected one of {expected}"
        ) from None


DEFAULT_RECOMPUTE_RATIO = 0.15

# How a decode step reads each sequence's KV blocks (engine/runner.py, ModelRunner.attention);
# the setting adds auto: the device's default, per row on the CPU and batched elsewhere.
AttentionPath = Literal["per_row", "batched", "flex"]
DecodeAttention = Literal["auto", "per_row", "batched", "flex"]


@dataclass(frozen=True)
class Penalties:
    """Sampling penalties as OpenAI and vLLM define them: `presence` and `frequency` are
    subtracted from the logit of every token generated so far, once and once per occurrence;
    a positive logit of a token of the prompt or the output is divided by `repetition`, a
    negative one multiplied. 0, 0 and 1 (the defaults) change nothing."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0

    def __post_init__(self) -> None:
        additive = (("presence_penalty", self.presence), ("frequency_penalty", self.frequency))
        for name, value in additive:
            if not (math.isfinite(value) and abs(value) <= MAX_ADDITIVE_PENALTY):
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}")
        repetition = self.repetition
        if not (math.isfinite(repetition) and 0.0 < repetition <= MAX_REPETITION_PENALTY):
            raise InvalidRequestError(f"repetition_penalty must be in (0, 2], got {repetition}")

    @property
    def neutral(self) -> bool:
        return self.presence == 0.0 and self.frequency == 0.0 and self.repetition == 1.0

    def replace_unset(
        self, presence: float | None, frequency: float | None, repetition: float | None
    ) -> Penalties:
        """These penalties with each one given (not None) replaced."""
        return Penalties(
            self.presence if presence is None else presence,
            self.frequency if frequency is None else frequency,
            self.repetition if repetition is None else repetition,
        )


NO_PENALTIES = Penalties()


@dataclass(frozen=True)
class GenerationDefaults:
    """What a request gets for a sampling field it leaves out; None: not set at this level.
    The engine's settings come first, then the model's generation_config, then greedy
    decoding without penalties (GREEDY)."""

    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None

    def over(self, fallback: GenerationDefaults) -> GenerationDefaults:
        """These defaults, each one left None taken from `fallback`."""
        return GenerationDefaults(
            *(
                mine if mine is not None else theirs
                for mine, theirs in zip(self._values(), fallback._values(), strict=True)
            )
        )

    def _values(self) -> tuple[float | None, ...]:
        return (
            self.temperature,
            self.top_p,
            self.presence_penalty,
            self.frequency_penalty,
            self.repetition_penalty,
        )

    @property
    def penalties(self) -> Penalties:
        return NO_PENALTIES.replace_unset(
            self.presence_penalty, self.frequency_penalty, self.repetition_penalty
        )


GREEDY = GenerationDefaults(0.0, 1.0, 0.0, 0.0, 1.0)


@dataclass(frozen=True)
class Chunk:
    """One retrieved passage; `id` names it in logs and routing, the KV key is its tokens and
    `cache_salt` (its tenant's scope: KV stored under one salt is never found under another)."""

    id: str
    text: str
    cache_salt: str = ""


@dataclass(frozen=True)
class TokenLogprob:
    """One token with its log-probability (None: a prompt's first token, which nothing
    predicts) and, most likely first, the tokens the request asked to see beside it."""

    token_id: int
    token: str  # the token decoded on its own
    logprob: float | None
    top: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Turn:
    """One earlier turn of a conversation: `role` "user" or "assistant"."""

    role: TurnRole
    text: str


def check_history(history: tuple[Turn, ...]) -> None:
    """InvalidRequestError unless `history` is at most MAX_HISTORY_TURNS turns, none blank,
    whose roles pass common.contract.history_error."""
    if len(history) > MAX_HISTORY_TURNS:
        raise InvalidRequestError(
            f"history has {len(history)} turns: more than the limit of {MAX_HISTORY_TURNS}"
        )
    error = history_error([turn.role for turn in history])
    if error is not None:
        raise InvalidRequestError(error)
    for index, turn in enumerate(history):
        if not turn.text.strip():
            raise InvalidRequestError(f"history.{index}.text must not be empty")


@dataclass(frozen=True)
class GenerateRequest:
    """One question over chunks. `recompute_ratio=None` takes the engine's default, and so
    do `selection` and each penalty left None (the engine's default penalties).
    `recompute_ratio="auto"` lets the check layer choose r by quality (docs/quality.md), at
    most `max_recompute_ratio` (None: the engine's auto_max_ratio)."""

    question: str
    chunks: tuple[Chunk, ...] = ()
    system: str | None = None
    # The conversation before the question, oldest first (check_history).
    history: tuple[Turn, ...] = ()
    mode: Mode = Mode.CACHEBLEND
    recompute_ratio: float | Literal["auto"] | None = None
    selection: Selection | None = None
    max_recompute_ratio: float | None = None
    max_tokens: int = 64
    # None: the engine's default (GenerationDefaults: its settings, the model's, greedy).
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # keep generating past EOS (benchmarks, like vLLM's option)
    # Drop the oldest turns of history, then chunks from the end, until prompt + max_tokens
    # fits max_model_len (engine.blend.layout.fit_prompt; else too long).
    fit_context: bool = False
    chunk_order: ChunkOrder = ChunkOrder.BEST_FIRST  # applied after fit_context
    # The prompt as it is, without template, system text or chunks: `question`'s text
    # tokenized as vLLM's /v1/completions does, or these token ids (then `question` is unused).
    raw_prompt: bool = False
    prompt_token_ids: tuple[int, ...] | None = None
    # Each generated token's log-probability under the distribution it was sampled from, with
    # this many top alternatives (None: none computed); of every prompt token after the first,
    # under the model's own distribution (full_prefill only: each position is computed).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # The JSON schema the output must validate against, serialized (None: free text): each
    # token is sampled among those its grammar allows (engine/grammar/).
    json_schema: str | None = None
    # The scope of the prompt prefix's cached KV (system prompt, template start), as vLLM's
    # cache_salt: a prefix cached under one salt is not reused under another.
    cache_salt: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", _parse_enum(Mode, self.mode, "mode"))
        object.__setattr__(
            self, "chunk_order", _parse_enum(ChunkOrder, self.chunk_order, "chunk_order")
        )
        object.__setattr__(self, "chunks", tuple(self.chunks))
        object.__setattr__(self, "stop", tuple(self.stop))
        if self.prompt_token_ids is not None:
            object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
            if not self.prompt_token_ids:
                raise InvalidRequestError("prompt_token_ids must not be empty")
        elif not self.question.strip():
            raise InvalidRequestError("question must not be empty")
        if self.raw_prompt and self.chunks:
            raise InvalidRequestError("a raw prompt has no chunks")
        for name, count in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if count is not None and not 0 <= count <= MAX_LOGPROBS:
                raise InvalidRequestError(f"{name} must be in [0, {MAX_LOGPROBS}], got {count}")
        if self.prompt_logprobs is not None and self.mode is not Mode.FULL_PREFILL:
            raise InvalidRequestError(
                "prompt_logprobs needs mode full_prefill (every prompt position computed)"
            )
        object.__setattr__(self, "history", tuple(self.history))
        check_history(self.history)
        if self.raw_prompt and self.history:
            raise InvalidRequestError("a raw prompt has no history")
        if self.selection is not None:
            object.__setattr__(
                self, "selection", _parse_enum(Selection, self.selection, "selection")
            )
        ratio = self.recompute_ratio
        if ratio is not None and ratio != AUTO_RATIO and not _is_ratio(ratio):
            raise InvalidRequestError(f"recompute_ratio must be in [0, 1] or 'auto', got {ratio}")
        bound = self.max_recompute_ratio
        if bound is not None and not _is_ratio(bound):
            raise InvalidRequestError(f"max_recompute_ratio must be in [0, 1], got {bound}")
        if bound is not None and ratio != AUTO_RATIO:
            raise InvalidRequestError("max_recompute_ratio bounds recompute_ratio 'auto' only")
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        temperature, top_p = self.temperature, self.top_p
        if temperature is not None and not (math.isfinite(temperature) and temperature >= 0.0):
            raise InvalidRequestError(f"temperature must be >= 0, got {temperature}")
        if top_p is not None and not (0.0 < top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {top_p}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty")
        self.penalties(NO_PENALTIES)  # raises for a penalty out of range

    def penalties(self, default: Penalties) -> Penalties:
        """The request's penalties, each one it leaves None taken from `default`."""
        return default.replace_unset(
            self.presence_penalty, self.frequency_penalty, self.repetition_penalty
        )

    def sampling(self, defaults: GenerationDefaults) -> tuple[float, float, Penalties]:
        """Temperature, top_p and penalties: the request's, else `defaults`' (resolved down to
        GREEDY)."""
        resolved = defaults.over(GREEDY)
        temperature = self.temperature if self.temperature is not None else resolved.temperature
        top_p = self.top_p if self.top_p is not None else resolved.top_p
        assert temperature is not None and top_p is not None
        return temperature, top_p, self.penalties(resolved.penalties)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Tokens whose KV came from a cache unchanged (prefix cache or chunk cache).
    cached_tokens: int = 0
    # Chunk tokens whose KV was computed for this request (selected, or of an uncached chunk).
    recomputed_tokens: int = 0


@dataclass
class Timings:
    ttft_s: float = 0.0  # from arrival, queueing included
    queue_s: float = 0.0  # from arrival until the prefill started
    prefill_s: float = 0.0
    kv_load_s: float = 0.0
    kv_wait_s: float = 0.0
    recompute_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    # Fraction of the KV load time hidden behind compute (1.0 when nothing was loaded).
    overlap: float = 1.0


@dataclass(frozen=True)
class StepRecord:
    """One engine step, for metrics: its decode batch and its prefill work, each timed.
    `prefill_tokens`: the prompt tokens of the prefills that completed in the step. A decode
    that was fused into the prefills' forward has decode_s 0, its time in prefill_s."""

    num_decodes: int
    decode_s: float
    num_prefills: int  # prefills that computed in the step, whole or a piece
    prefill_tokens: int
    prefill_s: float

    @property
    def seconds(self) -> float:
        return self.decode_s + self.prefill_s

    @property
    def decode_fused(self) -> bool:
        """The decode ran in the prefills' forward: its time is in prefill_s (decode_s 0)."""
        return bool(self.num_decodes and self.num_prefills) and self.decode_s == 0.0


@dataclass
class TokenDelta:
    """Text produced by one decoding step (empty while a multi-byte character or a possible stop
    string is held back)."""

    text: str
    token_id: int | None
    logprobs: TokenLogprob | None = None  # of token_id, when the request asked
    # Sent once, before the first token, when the request asked for them.
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass
class LayerTimes:
    """When one layer's KV was loaded (None: not loaded) and when the layer was computed, in
    seconds since the prefill started."""

    layer: int
    load_start_s: float | None
    load_end_s: float | None
    compute_start_s: float
    compute_end_s: float


@dataclass
class Blend:
    """How the prompt was built: the ratio used, the leading full layers, who chose them."""

    recompute_ratio: float  # of the blended tokens, those recomputed (auto: what it chose)
    leading_layers: int
    chosen_by: str  # "request", "engine", "controller" or "auto"
    fell_back_to_full_prefill: bool = False
    selection: str = Selection.HKVD.value


@dataclass
class GenerateResult:
    text: str
    finish_reason: str
    usage: Usage
    timings: Timings
    blend: Blend
    token_ids: list[int] = field(default_factory=list)
    layers: list[LayerTimes] = field(default_factory=list)
    # Where each chunk's KV was found at lookup ("memory", "ssd" or None), and bytes read.
    chunk_tiers: list[str | None] = field(default_factory=list)
    load_bytes_by_tier: dict[str, int] = field(default_factory=dict)
    dropped_chunks: int = 0  # by fit_context, from the end of the request's chunks
    # When the request asked: one per generated token (an EOS that ended it included), and
    # one per prompt token, the first with logprob None.
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    dropped_turns: int = 0  # by fit_context, the oldest turns of the request's history


@dataclass(frozen=True)
class ChunkWrite:
    """What precomputing one chunk did: skipped (already stored), or computed `nbytes` of KV
    whose write to the store's last tier `written` resolves (True) or failed (False)."""

    skipped: bool
    nbytes: int = 0
    written: Future[bool] | None = None


@dataclass
class PrecomputeResult:
    """Chunks written to the store's last tier (SSD, else memory), already there, and computed
    but not written (a failed SSD write: memory-only at best); bytes of KV computed."""

    stored: int = 0
    skipped: int = 0
    failed: int = 0
    bytes: int = 0
