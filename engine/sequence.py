"""One request's state while the engine serves it: prompt layout, KV slot, sampler, text,
counters and status. The scheduler reads only its counts; the runner reads its slot."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING

from engine.detokenize import IncrementalText
from engine.prompt import PromptLayout
from engine.types import NO_PENALTIES, GenerateRequest, GenerateResult, Penalties, TokenDelta

if TYPE_CHECKING:
    from engine.prefill import Prefill
    from engine.sampling import Sampler
    from engine.shadow import ShadowSample

Event = TokenDelta | GenerateResult | BaseException
_ids = itertools.count()


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    request: GenerateRequest
    layout: PromptLayout
    sampler: Sampler
    text: IncrementalText
    emit: Callable[[Event], None]  # hands an event to the consumer; called on the engine thread
    arrival_s: float
    penalties: Penalties = NO_PENALTIES  # the request's, the engine's defaults filled in
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int | None = None
    num_cached: int = 0  # positions whose KV is in the slot
    next_token: int | None = None  # sampled, not yet fed to the model
    finish_reason: str | None = None
    cancelled: bool = False
    prefill: Prefill | None = None
    scheduled_s: float | None = None
    first_token_s: float | None = None
    shadow: ShadowSample | None = None  # sampled for a shadow check: what the blend gave

    @property
    def num_prompt_tokens(self) -> int:
        return self.layout.num_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.text.token_ids)

    @property
    def max_tokens(self) -> int:
        return self.request.max_tokens

    @property
    def max_positions(self) -> int:
        """Positions the sequence may fill: the prompt plus every token it may decode."""
        return self.num_prompt_tokens + self.max_tokens
