"""Shadow quality checks while serving: a sampled share of blended requests is prefilled again
in full, on idle time and a guaranteed share of busy steps, and compared with the blend."""

from __future__ import annotations

import collections
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.blend.dense import run_to_end
from engine.blend.loop import layer_loop
from engine.blend.plan import PrefillPlan
from engine.model.layers import LayerOps
from engine.quality import agreement
from engine.types import Mode
from kvstore.types import ChunkKV, kv_token_bytes

log = logging.getLogger(__name__)

# Modes whose prefill reuses KV that is not exact; full_prefill and prefix_cache build exactly
# what the shadow would, so checking them would cost compute to learn nothing.
SAMPLED_MODES = (Mode.CACHEBLEND, Mode.FULL_REUSE)
# Why a sampled request got no check (the label values of the skipped counter).
SKIP_REASONS = ("busy", "queue_full", "budget", "memory", "preempted", "error")
# Prompt tokens per piece of the shadow's prefill: a request arriving while a piece runs waits
# for that piece alone.
PIECE_TOKENS = 512
# Under load, one shadow piece after this many engine steps: without a share of its own a busy
# engine checks nothing, exactly when its quality matters most.
EVERY_STEPS = 16
# The shadow's KV at most: what a full-prompt K and V cost (1 GiB for an 8B model at 8K).
MAX_KV_BYTES = 1 << 30


@dataclass(frozen=True)
class ShadowConfig:
    """`fraction` of eligible requests sampled (0: off); `max_tokens` tokens of full prefill's
    greedy answer compared; `top_k` of the top-k agreement; at most `max_queue` checks pending;
    shadow compute at most `max_share` of the wall time since the engine started; under load
    one piece after every `every_steps` engine steps (0: idle time only, and a request arriving
    drops the pending checks); at most `max_kv_bytes` of KV held by the pending checks."""

    fraction: float = 0.0
    max_tokens: int = 16
    top_k: int = 5
    max_queue: int = 4
    max_share: float = 0.1
    piece_tokens: int = PIECE_TOKENS
    every_steps: int = EVERY_STEPS
    max_kv_bytes: int = MAX_KV_BYTES

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"shadow fraction must be in [0, 1], got {self.fraction}")
        if min(self.max_tokens, self.top_k, self.max_queue, self.piece_tokens) < 1:
            raise ValueError("shadow max_tokens, top_k, max_queue and piece_tokens must be >= 1")
        if self.every_steps < 0 or self.max_kv_bytes < 1:
            raise ValueError(
                f"shadow every_steps must be >= 0 and max_kv_bytes >= 1, got "
                f"{self.every_steps} and {self.max_kv_bytes}"
            )
        if not 0.0 < self.max_share <= 1.0:
            raise ValueError(f"shadow max_share must be in (0, 1], got {self.max_share}")


@dataclass
class ShadowSample:
    """What a sampled request's blended prefill gave: its prompt KV `kv` ([L, H_kv, prompt, D]
    each: its prefill's own buffer until `Shadow.submit` copies them to the host), its first
    logits and, when it decodes greedily, its first tokens (EOS included). Filled on the engine
    thread while it runs."""

    mode: Mode
    prompt: tuple[int, ...]
    greedy: bool
    max_tokens: int
    kv: tuple[torch.Tensor, torch.Tensor] | None = None
    first_logits: torch.Tensor | None = None
    tokens: list[int] = field(default_factory=list)

    def observe(self, logits: torch.Tensor, token: int) -> None:
        if self.first_logits is None:
            self.first_logits = logits.detach().to("cpu", torch.float32).clone()
        if self.greedy and len(self.tokens) < self.max_tokens:
            self.tokens.append(token)


@dataclass(frozen=True)
class ShadowReport:
    """One check: the blend against full prefill of the same prompt. `greedy_agreement` is
    None when the request did not decode greedily (its tokens are not a greedy continuation).
    `answer_*` is the teacher-forced deviation over `answer_tokens` positions: full prefill's
    greedy answer fed after the blend's prompt KV, mean KL(full ‖ blend) of the next-token
    distributions and the share of positions whose argmax agrees."""

    mode: Mode
    first_token_agrees: bool
    topk_agreement: float
    kl_divergence: float
    greedy_agreement: float | None
    greedy_tokens: int
    answer_kl: float
    answer_argmax_agreement: float
    answer_tokens: int
    seconds: float


@dataclass
class ShadowStats:
    """Counts since start; keys fixed up front, so a scrape can read them while they change.
    `eligible`: requests a check could have been sampled from (a reuse mode that reused)."""

    eligible: dict[Mode, int] = field(default_factory=lambda: dict.fromkeys(SAMPLED_MODES, 0))
    checks: dict[Mode, int] = field(default_factory=lambda: dict.fromkeys(SAMPLED_MODES, 0))
    first_token_agreements: dict[Mode, int] = field(
        default_factory=lambda: dict.fromkeys(SAMPLED_MODES, 0)
    )
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIP_REASONS, 0))
    seconds: float = 0.0


@dataclass
class _CheckInProgress:
    """A check in progress: full prefill's KV computed so far, its greedy answer and the
    next-token logits at each answer position, then the blend's, teacher-forced."""

    sample: ShadowSample
    answer_tokens: int
    keys: torch.Tensor  # [L, H_kv, prompt + answer tokens - 1, D]
    values: torch.Tensor
    done: int = 0  # positions whose KV is computed
    tokens: list[int] = field(default_factory=list)  # full prefill's greedy answer
    full_logits: list[torch.Tensor] = field(default_factory=list)  # [vocab] each, on the host
    blend_logits: list[torch.Tensor] = field(default_factory=list)  # answer positions 1..
    seconds: float = 0.0

    @property
    def finished(self) -> bool:
        answered = len(self.tokens) == self.answer_tokens
        return answered and len(self.blend_logits) == self.answer_tokens - 1


class Shadow:
    """Samples requests, queues their checks and runs them a piece at a time.

    Every method runs on the engine's worker thread: `sample` when a prefill is done, `submit`
    when the request has finished (before its KV blocks are used again), `preempt` when client
    work needs a step, `run_piece` when the worker has nothing else to do and after every
    `every_steps` steps under load.
    """

    def __init__(self, ops: LayerOps, config: ShadowConfig, rng: random.Random | None = None):
        self.ops = ops
        self.config = config
        self.stats = ShadowStats()
        self._rng = rng or random.Random()
        self._queue: collections.deque[ShadowSample] = collections.deque()
        self._job: _CheckInProgress | None = None
        self._started_s = time.monotonic()
        self._listeners: list[Callable[[ShadowReport], None]] = []
        self._reserved: dict[int, int] = {}  # KV bytes held per pending sample (by id)

    def add_listener(self, listener: Callable[[ShadowReport], None]) -> None:
        """Call `listener` with every finished check, on the worker thread."""
        self._listeners.append(listener)

    @property
    def pending(self) -> int:
        """Checks queued or in progress."""
        return len(self._queue) + (self._job is not None)

    @property
    def kv_bytes(self) -> int:
        """KV bytes the pending checks hold or will hold (at most `max_kv_bytes`)."""
        return sum(self._reserved.values())

    def sample(
        self,
        mode: Mode,
        prompt: tuple[int, ...],
        greedy: bool,
        fell_back: bool,
        read_kv: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> ShadowSample | None:
        """A sample to fill while the request decodes, for `fraction` of the eligible requests:
        a reuse mode that did reuse (a cacheblend fallback computed everything but the cached
        prefix). `read_kv()` copies the prompt's KV as the prefill built it (called for a
        sample only)."""
        if mode not in SAMPLED_MODES or fell_back:
            return None
        self.stats.eligible[mode] += 1
        if self.config.fraction <= 0.0 or self._rng.random() >= self.config.fraction:
            return None
        kv = read_kv() if read_kv is not None else None
        return ShadowSample(mode, prompt, greedy, self.config.max_tokens, kv)

    def submit(self, sample: ShadowSample, busy: bool) -> None:
        """Queue the check of a finished request, copying its prompt KV to the host, unless
        other requests wait or run (`busy`) and the shadow has no share of busy steps, the
        queue is full, the shadow has used its share of the time, or its KV would pass
        `max_kv_bytes` (the copy, plus the full prefill's KV while the check runs)."""
        assert sample.first_logits is not None, "a finished request saw its first logits"
        assert sample.kv is not None, "a sample carries its prompt's KV"
        elapsed = time.monotonic() - self._started_s
        need = self._kv_bytes(len(sample.prompt)) + self._kv_bytes(self._positions(sample))
        if busy and not self.config.every_steps:
            self._skip("busy")
        elif self.pending >= self.config.max_queue:
            self._skip("queue_full")
        elif self.stats.seconds > self.config.max_share * elapsed:
            self._skip("budget")
        elif self.kv_bytes + need > self.config.max_kv_bytes:
            self._skip("memory")
        else:
            keys, values = sample.kv
            # The check keeps a host copy: the device buffer goes with the request.
            sample.kv = (keys.to("cpu", copy=True), values.to("cpu", copy=True))
            self._reserved[id(sample)] = need
            self._queue.append(sample)
            return
        sample.kv = None

    def preempt(self) -> None:
        """Client work came: without a share of busy steps (`every_steps` 0), drop every
        pending check, since shadows then run on idle time only; with one, keep them."""
        if self.config.every_steps:
            return
        for _ in range(self.pending):
            self._skip("preempted")
        self._queue.clear()
        self._job = None
        self._reserved.clear()

    def run_piece(self) -> bool:
        """Advance the pending check by one piece (a slice of its prefill, or one answer
        token); False when there is nothing to do."""
        if self._job is None:
            if not self._queue:
                return False
            sample = self._queue.popleft()
            try:
                self._job = self._start(sample)
            except Exception:  # e.g. out of device memory for its KV
                log.exception("shadow check failed to start")
                self._reserved.pop(id(sample), None)
                self._skip("error")
                return True
        job = self._job
        start = time.perf_counter()
        try:
            self._advance(job)
        except Exception:
            log.exception("shadow check failed")
            self._end(job)
            self._skip("error")
            return True
        finally:
            seconds = time.perf_counter() - start
            job.seconds += seconds
            self.stats.seconds += seconds
        if job.finished:
            self._end(job)
            self._report(job)
        return True

    def _skip(self, reason: str) -> None:
        self.stats.skipped[reason] += 1

    def _end(self, job: _CheckInProgress) -> None:
        self._job = None
        self._reserved.pop(id(job.sample), None)
        job.sample.kv = None

    def _kv_bytes(self, positions: int) -> int:
        shape = self.ops.shape
        token_bytes = kv_token_bytes(
            shape.num_kv_heads, shape.head_dim, self.ops.dtype, shape.num_layers
        )
        return token_bytes * positions

    def _positions(self, sample: ShadowSample) -> int:
        # The last answer token is only compared, never fed, so it needs no position.
        return len(sample.prompt) + self.config.max_tokens - 1

    def _start(self, sample: ShadowSample) -> _CheckInProgress:
        ops, shape = self.ops, self.ops.shape
        size = (shape.num_layers, shape.num_kv_heads, self._positions(sample), shape.head_dim)
        return _CheckInProgress(
            sample,
            self.config.max_tokens,
            torch.empty(size, dtype=ops.dtype, device=ops.device),
            torch.empty(size, dtype=ops.dtype, device=ops.device),
        )

    def _advance(self, job: _CheckInProgress) -> None:
        """Full prefill in pieces, each attending to the exact KV of those before (what one
        pass computes, up to float rounding), then one greedy token per call; then the same
        answer teacher-forced after the blend's prompt KV, one token per call."""
        prompt, answer = job.sample.prompt, job.answer_tokens
        if job.done < len(prompt):
            end = min(job.done + self.config.piece_tokens, len(prompt))
            logits = self._extend(job, prompt[:end])
            if end == len(prompt):
                self._full_answer(job, logits)
        elif len(job.tokens) < answer:
            self._full_answer(job, self._extend(job, prompt + tuple(job.tokens)))
        else:
            if not job.blend_logits:
                # Full prefill's prompt KV has served: the blend's takes its place.
                assert job.sample.kv is not None
                keys, values = job.sample.kv
                job.keys[:, :, : len(prompt)] = keys
                job.values[:, :, : len(prompt)] = values
                job.sample.kv = None
                job.done = len(prompt)
            fed = prompt + tuple(job.tokens[: len(job.blend_logits) + 1])
            job.blend_logits.append(self._extend(job, fed).to("cpu", torch.float32))

    @staticmethod
    def _full_answer(job: _CheckInProgress, logits: torch.Tensor) -> None:
        job.full_logits.append(logits.to("cpu", torch.float32))
        job.tokens.append(int(logits.argmax()))

    def _extend(self, job: _CheckInProgress, token_ids: tuple[int, ...]) -> torch.Tensor:
        """Compute positions job.done..len(token_ids)-1 over the KV before them; their last
        position's logits."""
        start, end = job.done, len(token_ids)
        plan = PrefillPlan(
            token_ids=token_ids,
            prefix_len=start,
            prefix_cached=start > 0,
            chunk_spans=(),
            chunk_sources=(),
            recompute_ratio=1.0,
            check_layers=(),
        )
        prefix = (
            ChunkKV(job.keys[:, :, :start], job.values[:, :, :start], rotated=True)
            if start
            else None
        )
        out = run_to_end(
            layer_loop(self.ops, plan, prefix, out=(job.keys[:, :, :end], job.values[:, :, :end]))
        )
        job.done = end
        return out.logits

    def _report(self, job: _CheckInProgress) -> None:
        sample, full = job.sample, job.full_logits[0]
        blend = sample.first_logits
        assert blend is not None
        answer = agreement.answer_deviation(
            torch.stack(job.full_logits), torch.stack([blend, *job.blend_logits])
        )
        compared = len(sample.tokens)
        report = ShadowReport(
            mode=sample.mode,
            first_token_agrees=agreement.first_token_agrees(full, blend),
            topk_agreement=agreement.topk_agreement(full, blend, self.config.top_k),
            kl_divergence=agreement.kl_divergence(full, blend),
            greedy_agreement=(
                agreement.greedy_agreement(job.tokens[:compared], sample.tokens)
                if compared
                else None
            ),
            greedy_tokens=compared,
            answer_kl=answer.kl,
            answer_argmax_agreement=answer.argmax_agreement,
            answer_tokens=answer.positions,
            seconds=job.seconds,
        )
        self.stats.checks[sample.mode] += 1
        self.stats.first_token_agreements[sample.mode] += report.first_token_agrees
        for listener in self._listeners:
            listener(report)
