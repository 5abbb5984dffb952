"""Waiting and running sequences, and the choice of what one engine step does, on token and
block counts alone (the policy: docs/engine.md, "The step policy").

A step has a budget of `max_num_batched_tokens` tokens. Every sequence whose prompt is cached
decodes one token, which counts `decode_weight` tokens. The prefills in flight share what is
left, in admission order, each at least MIN_PREFILL_TOKENS (none starves, however many decode),
leaving the head of the queue its floor; one that needs more pauses and goes on in the next
step. Waiting sequences are then admitted, first come first served, while the step has tokens
left, the KV pool's free blocks hold their prompt plus max_tokens (less the blocks of a
registered prompt prefix they share) and fewer than max_num_seqs run, and prefill in the same
step. With nothing decoding a step's prefills run whole. Background work (chunk precompute,
write-back) gets what the step leaves, at least MIN_PREFILL_TOKENS.
Plain Python: tensors live in the runner.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from engine.errors import PromptTooLongError, QueueFullError
from engine.sched.blocks import BlockManager
from engine.sched.sequence import Sequence, SequenceStatus
from engine.sched.shared_prefix import PrefixEntry, SharedPrefixes

S = TypeVar("S", bound=Sequence)

# The fewest tokens a step gives each prefill in flight, however many sequences decode or
# prefill before it: every prefill progresses every step. Small, because under load two or three
# prefills may be in flight and each floor comes on top of the budget (docs/benchmarks/serving.md,
# "A decoding sequence's weight").
MIN_PREFILL_TOKENS = 8


def prefill_shares(needs: list[float], left: float) -> list[float]:
    """Each prefill's tokens in a step, in order: what the step has left after those before it,
    at least MIN_PREFILL_TOKENS, at most what it still needs; all math.inf when `left` is."""
    if math.isinf(left):
        return [left] * len(needs)
    shares = []
    for need in needs:
        shares.append(min(need, max(MIN_PREFILL_TOKENS, left)))
        left -= shares[-1]
    return shares


@dataclass
class Step(Generic[S]):
    """What one engine step runs: a token for each of `decodes`, and for each of `prefills` (in
    flight first, then those admitted into this step, in admission order) its share of the
    step's tokens (`prefill_tokens`, math.inf: run whole), in one forward (engine/executor.py)."""

    decodes: list[S] = field(default_factory=list)
    prefills: list[S] = field(default_factory=list)
    prefill_tokens: list[float] = field(default_factory=list)
    max_num_batched_tokens: int | None = None
    decode_weight: float = 1.0  # the tokens of the budget one decoding sequence counts for
    num_waiting: int = 0  # requests still queued, not admitted, as the step was scheduled
    # What the step leaves background work: the budget less its decodes and prefill tokens (a
    # prefill run whole counts what it needs), at least MIN_PREFILL_TOKENS; math.inf: no budget.
    background_tokens: float = math.inf

    @property
    def sequences(self) -> list[S]:
        return [*self.decodes, *self.prefills]

    def budget(self, num_decoding: int) -> float:
        """What the step leaves its prefills when `num_decoding` sequences wait for a token:
        max_num_batched_tokens less decode_weight each; math.inf when none waits (a lone
        prefill runs whole) or without a budget."""
        return prefill_budget(self.max_num_batched_tokens, num_decoding, self.decode_weight)


def prefill_budget(
    max_num_batched_tokens: int | None, num_decoding: int, decode_weight: float = 1.0
) -> float:
    """The tokens a step leaves its prefills beside `num_decoding` decodes, each counting
    `decode_weight` (math.inf: no bound, nothing decodes or no budget)."""
    if not num_decoding or max_num_batched_tokens is None:
        return math.inf
    return max_num_batched_tokens - num_decoding * decode_weight


@dataclass(frozen=True)
class PoolUse:
    """The KV pool's blocks by holder, counted at one moment."""

    in_use: int  # held by running sequences (each shared block once): not reclaimable
    prefix_shared: int  # held by registered prefixes and by running sequences that share them
    prefix_idle: int  # held only by prefixes no sequence shares: admission gives them back


class Scheduler(Generic[S]):
    """`max_num_batched_tokens`: the tokens one step feeds the model, decodes first, each counting
    `decode_weight` prompt tokens (None: no bound; a step with decodes then runs its prefills
    whole). `max_prefill_tokens` bounds the prompt tokens admitted in one step (one sequence is
    always admitted). A sequence is admitted with the blocks of its prompt plus max_tokens, all
    reserved at once, so a running sequence never runs out of blocks and nothing is ever preempted;
    at most `max_num_seqs` run, each holding a lane (0..max_num_seqs-1) that indexes per-sequence
    rows such as penalties. Up to `shared_prefixes` exact prompt prefixes stay in the pool once
    cached, shared by every sequence admitted with one (engine/shared_prefix.py); those no sequence
    shares are given back, least recently used first, when the free blocks do not admit the next
    sequence."""

    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_waiting: int,
        max_prefill_tokens: int,
        max_num_batched_tokens: int | None = None,
        shared_prefixes: int = 0,
        decode_weight: float = 1.0,
    ):
        if max_num_seqs < 1 or max_waiting < 0 or max_prefill_tokens < 1:
            raise ValueError(
                f"need max_num_seqs >= 1, max_waiting >= 0 and max_prefill_tokens >= 1, got "
                f"{max_num_seqs}, {max_waiting} and {max_prefill_tokens}"
            )
        if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
            raise ValueError(f"need max_num_batched_tokens >= 1, got {max_num_batched_tokens}")
        if decode_weight <= 0:
            raise ValueError(f"need decode_weight > 0, got {decode_weight}")
        self.blocks = blocks
        self.prefixes = SharedPrefixes(blocks, shared_prefixes)
        self.max_num_seqs = max_num_seqs
        self._free_lanes = list(range(max_num_seqs))  # a heap: the lowest lane comes out first
        self.max_waiting = max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self.decode_weight = decode_weight
        self.waiting: deque[S] = deque()
        self.prefilling: list[S] = []  # admitted, prompt not yet cached, in admission order
        self.decoding: list[S] = []

    @property
    def running(self) -> list[S]:
        """Every sequence that holds KV blocks and a lane."""
        return [*self.prefilling, *self.decoding]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    def add(self, seq: S) -> None:
        """Queue `seq`; raises QueueFullError when `max_waiting` sequences already wait beyond
        those the free blocks and lanes admit at the next step, PromptTooLongError when its
        prompt plus max_tokens exceed the whole pool (the engine refuses a sequence longer than
        max_model_len before it gets here, and the pool holds at least one of those)."""
        if self.blocks.blocks_for(seq.max_positions) > self.blocks.num_blocks:
            raise PromptTooLongError(
                f"{seq.max_positions} positions need more than the KV pool's "
                f"{self.blocks.num_blocks} blocks of {self.blocks.block_size}"
            )
        if len(self.waiting) - self.num_admissible() >= self.max_waiting:
            raise QueueFullError(
                f"{len(self.waiting)} requests wait and the KV pool ({self.blocks.num_free_blocks} "
                f"of {self.blocks.num_blocks} blocks free, {len(self._free_lanes)} of "
                f"{self.max_num_seqs} sequences) admits no more of them"
            )
        self.waiting.append(seq)

    def num_admissible(self) -> int:
        """How many waiting sequences, in order, the free blocks and lanes would admit now."""
        return self._fit()[0]

    def startable_now(self) -> int:
        """Sequences that could start now: the waiting ones the pool admits, and one arrival of
        unknown length if every waiting one is admitted (none ahead of it is held up) and a
        lane and a block are left after them."""
        count, blocks_left = self._fit()
        room = count == len(self.waiting) and count < len(self._free_lanes) and blocks_left > 0
        return count + room

    def _fit(self) -> tuple[int, int]:
        """(waiting sequences admitted in order by the free blocks and lanes, blocks left, those
        of idle shared prefixes included): `_admit`'s choices, on counts."""
        blocks, lanes, count = self.blocks.num_free_blocks, len(self._free_lanes), 0
        idle = self.prefixes.idle()
        given_back: set[PrefixEntry] = set()
        for seq in self.waiting:
            if count == lanes:
                break
            entry = (seq.prefix_salt, seq.shared_prefix)
            shared = 0
            if entry not in given_back:
                shared = self.prefixes.shared_blocks(seq.shared_prefix, seq.prefix_salt)
            idle.pop(entry, None)  # shared from now on (or not registered)
            need = self.blocks.blocks_for(seq.max_positions) - shared
            while need > blocks and idle:
                gone, freed = idle.popitem(last=False)
                given_back.add(gone)
                blocks += freed
            if need > blocks:
                break
            blocks -= need
            count += 1
        return count, blocks + sum(idle.values())

    def pool_use(self) -> PoolUse:
        """The pool's blocks that running sequences hold, and those of the shared prefixes."""
        idle = self.prefixes.num_idle_blocks()
        in_use = self.blocks.num_blocks - self.blocks.num_free_blocks - idle
        return PoolUse(in_use, self.prefixes.num_blocks - idle, idle)

    def schedule(self) -> Step[S]:
        """The next step: every sequence whose prompt is cached decodes; the prefills in flight,
        then those admitted now, share the tokens the decodes leave (`prefill_shares`)."""
        self._promote_prefilled()
        left = prefill_budget(self.max_num_batched_tokens, len(self.decoding), self.decode_weight)
        # The prefills in flight leave the head of the queue its floor, when the pool admits it.
        head = MIN_PREFILL_TOKENS if self.waiting and self.num_admissible() else 0
        shares = prefill_shares([_prefill_need(seq) for seq in self.prefilling], left - head)
        if not math.isinf(left):
            left -= sum(shares)
        admitted = self._admit(left)
        shares += prefill_shares([_prefill_need(seq) for seq in admitted], left)
        self.prefilling += admitted
        return Step(
            list(self.decoding),
            list(self.prefilling),
            shares,
            self.max_num_batched_tokens,
            self.decode_weight,
            len(self.waiting),
            self._background_tokens(shares),
        )

    def _background_tokens(self, shares: list[float]) -> float:
        if self.max_num_batched_tokens is None:
            return math.inf
        needs = [_prefill_need(seq) for seq in self.prefilling]
        spent = len(self.decoding) * self.decode_weight + sum(map(min, shares, needs))
        return max(MIN_PREFILL_TOKENS, self.max_num_batched_tokens - spent)

    def _promote_prefilled(self) -> None:
        """Sequences whose prompt is cached decode from now on, their prompt prefixes shared."""
        done = [seq for seq in self.prefilling if _prompt_cached(seq)]
        for seq in done:
            self.prefilling.remove(seq)
            self._share_prefix(seq)
        self.decoding.extend(done)

    def _admit(self, left: float) -> list[S]:
        """Waiting sequences, in order, while their blocks and a lane are free and the step has
        prefill tokens `left` (with no prefill in flight, the first one whatever it has), within
        max_prefill_tokens (the first one always). Each gets the blocks of its prompt plus
        max_tokens, the first ones shared where its prefix is registered."""
        batch: list[S] = []
        budget = self.max_prefill_tokens
        while self.waiting and self._free_lanes:
            seq = self.waiting[0]
            if batch and seq.num_prompt_tokens > budget:
                break
            if left <= 0 and (batch or self.prefilling):
                break
            prefix, salt = seq.shared_prefix, seq.prefix_salt
            shared = self.prefixes.shared_blocks(prefix, salt)
            need = self.blocks.blocks_for(seq.max_positions) - shared
            if need > self.blocks.num_free_blocks:
                self.prefixes.reclaim(need, keep=prefix, salt=salt)
            if need > self.blocks.num_free_blocks:
                break  # first come, first served: no later, smaller sequence overtakes it
            self.waiting.popleft()
            seq.num_shared_tokens = self.prefixes.allocate(
                seq.seq_id, prefix, seq.max_positions, salt
            )
            seq.block_table = self.blocks.block_table(seq.seq_id)
            seq.lane = heapq.heappop(self._free_lanes)
            seq.status = SequenceStatus.RUNNING
            budget -= seq.num_prompt_tokens
            if not math.isinf(left):
                left -= prefill_shares([seq.num_prompt_tokens], left)[0]
            batch.append(seq)
        return batch

    def finish(self, seq: S) -> None:
        """Take `seq` out of the queues and free its blocks and lane at once (done, failed or
        cancelled)."""
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            if seq in self.prefilling:
                self.prefilling.remove(seq)
                # It may have finished in the step its prefill completed (max_tokens=1, EOS
                # first): its prefix is registered before its blocks go.
                self._share_prefix(seq)
            else:
                self.decoding.remove(seq)
            assert seq.lane is not None
            self.blocks.free(seq.seq_id)
            heapq.heappush(self._free_lanes, seq.lane)
            seq.block_table, seq.lane, seq.num_shared_tokens = [], None, 0
        seq.status = SequenceStatus.FINISHED

    def _share_prefix(self, seq: S) -> None:
        """Once its prompt is cached, its prefix's KV is in its blocks: later sequences may
        share them."""
        if seq.shared_prefix and _prompt_cached(seq):
            self.prefixes.register(seq.seq_id, seq.shared_prefix, seq.prefix_salt)

    def finish_done(self, seqs: list[S]) -> list[S]:
        """After a step: finish those of `seqs` that have a finish reason (returned), and move
        the prefills it completed to the decoding sequences, so that between steps admission
        counts (`num_admissible`, `startable_now`) and the queue estimate see their prefixes
        shared and their prefills done."""
        done = [seq for seq in seqs if seq.finish_reason is not None]
        for seq in done:
            self.finish(seq)
        self._promote_prefilled()
        return done

    def drop_cancelled(self) -> list[S]:
        """Finish every cancelled sequence, waiting or running; returns them."""
        cancelled = [seq for seq in [*self.waiting, *self.running] if seq.cancelled]
        for seq in cancelled:
            self.finish(seq)
        return cancelled

    def cancel_all(self) -> None:
        for seq in [*self.waiting, *self.running]:
            seq.cancelled = True


def _prefill_need(seq: Sequence) -> float:
    """Prompt tokens the prefill of `seq` may still compute (an upper bound: a blend computes
    fewer rows after its check layers)."""
    return max(seq.num_prompt_tokens - seq.num_prefilled, 1.0)


def _prompt_cached(seq: Sequence) -> bool:
    """Whether the KV of `seq`'s whole prompt is in its blocks (its prefill completed)."""
    return seq.num_cached >= seq.num_prompt_tokens
