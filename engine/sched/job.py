"""One request while the engine serves it: the scheduler's `Sequence` plus what producing its
tokens needs (prompt layout, sampler, penalties, grammar, text, consumer) and what it measured."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.blend.layout import PromptLayout
from engine.grammar.compile import CompiledGrammar, SequenceGrammar
from engine.sched.detokenize import IncrementalText
from engine.sched.sampling import Sampler
from engine.sched.sequence import Sequence
from engine.types import (
    GenerateRequest,
    GenerateResult,
    GenerationDefaults,
    Mode,
    Penalties,
    TokenDelta,
    TokenLogprob,
)

if TYPE_CHECKING:
    from engine.blend.budget import StepBudget
    from engine.blend.dense import Pausable
    from engine.blend.prefill import Prefill
    from engine.quality.shadow import ShadowSample
    from kvstore.loader import KVLayerStream

Event = TokenDelta | GenerateResult | BaseException


@dataclass(eq=False, kw_only=True)
class Job(Sequence):
    request: GenerateRequest
    layout: PromptLayout
    sampler: Sampler
    text: IncrementalText
    emit: Callable[[Event], None]  # hands an event to the consumer; called on the engine thread
    arrival_s: float
    penalties: Penalties  # the request's, the engine's defaults filled in
    prefill: Prefill | None = None
    # The prefill while it runs in pieces, its share of each step, and the KV stream opened
    # for it before it started.
    prefill_steps: Pausable[Prefill] | None = None
    budget: StepBudget | None = None
    opened: KVLayerStream | None = None
    scheduled_s: float | None = None
    first_token_s: float | None = None
    shadow: ShadowSample | None = None  # sampled for a shadow check: what the blend gave
    # Filled only when the request asks for them.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    grammar: SequenceGrammar | None = None  # the output's grammar (response_format), if any


def new_job(
    request: GenerateRequest,
    layout: PromptLayout,
    tokenizer: object,
    defaults: GenerationDefaults,
    emit: Callable[[Event], None],
    grammar: CompiledGrammar | None = None,
) -> Job:
    temperature, top_p, penalties = request.sampling(defaults)
    return Job(
        num_prompt_tokens=layout.num_tokens,
        max_tokens=request.max_tokens,
        # Full prefill is the no-reuse baseline: it computes its prefix too.
        shared_prefix=() if request.mode is Mode.FULL_PREFILL else layout.prefix,
        prefix_salt=layout.cache_salt,
        request=request,
        layout=layout,
        sampler=Sampler(temperature, top_p, request.seed),
        text=IncrementalText(tokenizer, request.stop),
        emit=emit,
        arrival_s=time.perf_counter(),
        penalties=penalties,
        grammar=None if grammar is None else grammar.start(),
    )
