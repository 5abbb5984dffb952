"""Shadow quality checks while serving: a sampled share of blended requests is prefilled again
in full, on idle time only, and compared with what the blend produced (engine/agreement.py)."""

from __future__ import annotations

import collections
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine import agreement
from engine.blend import PrefixKV, run_prefill
from engine.layers import LayerRunner
from engine.plan import PrefillPlan
from engine.types import Mode

log = logging.getLogger(__name__)

# Modes whose prefill reuses KV that is not exact; full_prefill and prefix_cache build exactly
# what the shadow would, so checking them would cost compute to learn nothing.
SAMPLED_MODES = (Mode.CACHEBLEND, Mode.FULL_REUSE)
# Why a sampled request got no check (the label values of the skipped counter).
SKIP_REASONS = ("busy", "queue_full", "budget", "preempted", "error")
# Prompt tokens per piece of the shadow's prefill: a request arriving while a piece runs waits
# for that piece alone, then the shadow is dropped.
PIECE_TOKENS = 512


@dataclass(frozen=True)
class ShadowConfig:
    """`fraction` of eligible requests sampled (0: off); `max_tokens` greedy tokens compared;
    `top_k` of the top-k agreement; at most `max_queue` checks pending; shadow compute at most
    `max_share` of the wall time since the engine started."""

    fraction: float = 0.0
    max_tokens: int = 16
    top_k: int = 5
    max_queue: int = 4
    max_share: float = 0.1
    piece_tokens: int = PIECE_TOKENS

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"shadow fraction must be in [0, 1], got {self.fraction}")
        if min(self.max_tokens, self.top_k, self.max_queue, self.piece_tokens) < 1:
            raise ValueError("shadow max_tokens, top_k, max_queue and piece_tokens must be >= 1")
        if not 0.0 < self.max_share <= 1.0:
            raise ValueError(f"shadow max_share must be in (0, 1], got {self.max_share}")


@dataclass
class ShadowSample:
    """What a sampled request's blended prefill gave: its first logits and, when it decodes
    greedily, its first tokens (EOS included). Filled on the engine thread while it runs."""

    mode: Mode
    prompt: tuple[int, ...]
    greedy: bool
    max_tokens: int
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
    None when the request did not decode greedily (its tokens are not a greedy continuation)."""

    mode: Mode
    first_token_agrees: bool
    topk_agreement: float
    kl_divergence: float
    greedy_agreement: float | None
    greedy_tokens: int
    seconds: float


@dataclass
class ShadowStats:
    """Counts since start; keys fixed up front, so a scrape can read them while they change."""

    checks: dict[Mode, int] = field(default_factory=lambda: dict.fromkeys(SAMPLED_MODES, 0))
    first_token_agreements: dict[Mode, int] = field(
        default_factory=lambda: dict.fromkeys(SAMPLED_MODES, 0)
    )
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIP_REASONS, 0))
    seconds: float = 0.0


@dataclass
class _Job:
    """A check in progress: the full-prefill KV computed so far and the greedy tokens."""

    sample: ShadowSample
    keys: torch.Tensor  # [L, H_kv, prompt + greedy tokens - 1, D]
    values: torch.Tensor
    done: int = 0  # positions whose KV is computed
    first_logits: torch.Tensor | None = None
    tokens: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def finished(self) -> bool:
        return self.first_logits is not None and len(self.tokens) >= len(self.sample.tokens)


class Shadow:
    """Samples requests, queues their checks and runs them a piece at a time.

    Every method runs on the engine's worker thread: `sample` when a prefill is done, `submit`
    when the request has finished, `preempt` when client work needs a step, `run_piece` when
    the worker has nothing else to do.
    """

    def __init__(self, runner: LayerRunner, config: ShadowConfig, rng: random.Random | None = None):
        self.runner = runner
        self.config = config
        self.stats = ShadowStats()
        self._rng = rng or random.Random()
        self._queue: collections.deque[ShadowSample] = collections.deque()
        self._job: _Job | None = None
        self._started_s = time.monotonic()
        self._listeners: list[Callable[[ShadowReport], None]] = []

    def add_listener(self, listener: Callable[[ShadowReport], None]) -> None:
        """Call `listener` with every finished check, on the worker thread."""
        self._listeners.append(listener)

    @property
    def pending(self) -> int:
        """Checks queued or in progress."""
        return len(self._queue) + (self._job is not None)

    def sample(
        self, mode: Mode, prompt: tuple[int, ...], greedy: bool, fell_back: bool
    ) -> ShadowSample | None:
        """A sample to fill while the request decodes, for `fraction` of the eligible requests:
        a reuse mode that did reuse (a cacheblend fallback computed everything but exact KV)."""
        if mode not in SAMPLED_MODES or fell_back or self.config.fraction <= 0.0:
            return None
        if self._rng.random() >= self.config.fraction:
            return None
        return ShadowSample(mode, prompt, greedy, self.config.max_tokens)

    def submit(self, sample: ShadowSample, busy: bool) -> None:
        """Queue the check of a finished request, unless other requests wait or run (`busy`),
        the queue is full or the shadow has used its share of the time."""
        assert sample.first_logits is not None, "a finished request saw its first logits"
        elapsed = time.monotonic() - self._started_s
        if busy:
            self._skip("busy")
        elif self.pending >= self.config.max_queue:
            self._skip("queue_full")
        elif self.stats.seconds > self.config.max_share * elapsed:
            self._skip("budget")
        else:
            self._queue.append(sample)

    def preempt(self) -> None:
        """Client work came: drop every pending check. Shadows run on idle time only."""
        for _ in range(self.pending):
            self._skip("preempted")
        self._queue.clear()
        self._job = None

    def run_piece(self) -> bool:
        """Advance the pending check by one piece (a slice of its prefill, or one greedy
        token); False when there is nothing to do."""
        if self._job is None:
            if not self._queue:
                return False
            self._job = self._start(self._queue.popleft())
        job = self._job
        start = time.perf_counter()
        try:
            self._advance(job)
        except Exception:
            log.exception("shadow check failed")
            self._job = None
            self._skip("error")
            return True
        finally:
            seconds = time.perf_counter() - start
            job.seconds += seconds
            self.stats.seconds += seconds
        if job.finished:
            self._job = None
            self._report(job)
        return True

    def _skip(self, reason: str) -> None:
        self.stats.skipped[reason] += 1

    def _start(self, sample: ShadowSample) -> _Job:
        runner, shape = self.runner, self.runner.shape
        # The last greedy token is only compared, never fed, so it needs no position.
        positions = len(sample.prompt) + max(len(sample.tokens) - 1, 0)
        size = (shape.num_layers, shape.num_kv_heads, positions, shape.head_dim)
        return _Job(
            sample,
            torch.empty(size, dtype=runner.dtype, device=runner.device),
            torch.empty(size, dtype=runner.dtype, device=runner.device),
        )

    def _advance(self, job: _Job) -> None:
        """Full prefill in pieces, each attending to the exact KV of those before (what one
        pass computes, up to float rounding), then one greedy token per call."""
        prompt = job.sample.prompt
        if job.done < len(prompt):
            end = min(job.done + self.config.piece_tokens, len(prompt))
            logits = self._extend(job, prompt[:end])
            if end == len(prompt):
                job.first_logits = logits
                job.tokens.append(int(logits.argmax()))
        else:
            logits = self._extend(job, prompt + tuple(job.tokens))
            job.tokens.append(int(logits.argmax()))

    def _extend(self, job: _Job, token_ids: tuple[int, ...]) -> torch.Tensor:
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
        prefix = PrefixKV(job.keys[:, :, :start], job.values[:, :, :start]) if start else None
        out = run_prefill(
            self.runner, plan, prefix, out=(job.keys[:, :, :end], job.values[:, :, :end])
        )
        job.done = end
        return out.logits

    def _report(self, job: _Job) -> None:
        sample, full = job.sample, job.first_logits
        blend = sample.first_logits
        assert full is not None and blend is not None
        full = full.to("cpu", torch.float32)
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
            seconds=job.seconds,
        )
        self.stats.checks[sample.mode] += 1
        self.stats.first_token_agreements[sample.mode] += report.first_token_agrees
        for listener in self._listeners:
            listener(report)
