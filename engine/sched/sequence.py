"""What the scheduler sees of a request: token counts, its KV blocks and its status. Plain data,
no runtime objects; the engine's full view of a request is `Job` (engine/job.py)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum, auto

_ids = itertools.count()


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False, kw_only=True)
class Sequence:
    num_prompt_tokens: int
    max_tokens: int
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    lane: int | None = None  # a small id while running: its row of per-sequence state
    block_table: list[int] = field(default_factory=list)  # its KV blocks while running
    # The exact prompt prefix whose full blocks it may share in the pool (engine/shared_prefix.py;
    # empty: it shares none), and its leading positions whose blocks are shared while running.
    shared_prefix: tuple[int, ...] = ()
    prefix_salt: str = ""  # its request's cache salt: it shares only prefixes of the same salt
    num_shared_tokens: int = 0
    num_cached: int = 0  # positions whose KV is in its blocks
    # Prompt tokens its prefill has computed so far, counted in token-layers over the layers.
    num_prefilled: float = 0.0
    num_output_tokens: int = 0  # tokens handed to the consumer
    next_token: int | None = None  # sampled, not yet fed to the model
    finish_reason: str | None = None
    cancelled: bool = False

    @property
    def max_positions(self) -> int:
        """Positions the sequence may fill: the prompt plus every token it may decode."""
        return self.num_prompt_tokens + self.max_tokens
