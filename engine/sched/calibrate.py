"""The step token budget from this machine's speeds, measured once when the engine starts: as
many prompt tokens per step as cost PREFILL_DECODE_STEPS decode steps of one sequence, and what
one more decoding sequence costs in prompt tokens, so that a decoding sequence's time per token
under load stays a small multiple of its time alone however many decode."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.blend.dense import run_to_end
from engine.blend.loop import layer_loop
from engine.blend.plan import PrefillPlan
from engine.model.layers import LayerOps
from engine.runner.model_runner import ModelRunner
from engine.sched.scheduler import MIN_PREFILL_TOKENS

log = logging.getLogger(__name__)

# A step's prefill work, and its decoding sequences beyond the first, cost at most this many lone
# decode steps: a step takes ~2 of them, which leaves the floors of several prefills in flight and
# a shared machine's drift inside the 3x a decoding sequence may take under load (the overload
# target; 1.5 left cacheblend's TPOT p99 at 3.3x: docs/benchmarks/serving.md).
PREFILL_DECODE_STEPS = 1.0
# The most tokens a step feeds the model: past it a GPU's step costs more than its decodes'
# time for little more prefill throughput (docs/benchmarks/serving.md, "The step budget").
MAX_STEP_TOKENS = 2048
# The prompts timed: their difference is the cost of a prompt token, without the fixed costs
# of a forward (which the decode of the same step pays already).
SHORT_PROMPT, LONG_PROMPT = 64, 256
# The decode batch timed against one sequence: the difference is what one more decoding
# sequence costs (on a CPU a decode row reads every weight for little more work, so one
# sequence's step costs ~20 prompt tokens and each further one ~2).
DECODE_BATCH = 8
REPEATS = 3


@dataclass(frozen=True)
class MeasuredBudget:
    """A step's budget in prompt tokens (`Scheduler`'s max_num_batched_tokens), and the prompt
    tokens one decoding sequence counts for in it (1: a decode row costs what a prompt token
    does, as on a GPU)."""

    tokens: int
    decode_weight: float = 1.0


def measure_step_budget(ops: LayerOps, runner: ModelRunner, max_num_seqs: int) -> MeasuredBudget:
    """PREFILL_DECODE_STEPS x (one decode step / one prompt token) prompt tokens per step,
    within [MIN_PREFILL_TOKENS, MAX_STEP_TOKENS], and a decoding sequence's weight: what a
    decode of DECODE_BATCH sequences (at most max_num_seqs) costs beyond one, per further
    sequence, in prompt tokens (at least 1). Each timed on this machine, the device
    synchronised around each run; medians of REPEATS."""
    long = min(LONG_PROMPT, runner.max_model_len - 1)
    short = min(SHORT_PROMPT, long // 2)
    if short < 1:
        return MeasuredBudget(MIN_PREFILL_TOKENS)
    batch = max(1, min(DECODE_BATCH, max_num_seqs))
    with torch.inference_mode():
        _prefill(ops, short)  # warm: allocator, kernels, RoPE tables
        _decode(runner, long, 1)
        _decode(runner, long, batch)  # batch 1: a second warm-up
        short_s = _median_s(ops.device, lambda: _prefill(ops, short))
        long_s = _median_s(ops.device, lambda: _prefill(ops, long))
        decode_s = _median_s(ops.device, lambda: _decode(runner, long, 1))
        batch_s = decode_s
        if batch > 1:
            batch_s = _median_s(ops.device, lambda: _decode(runner, long, batch))
    token_s = max(long_s - short_s, 1e-9) / (long - short)
    tokens = int(PREFILL_DECODE_STEPS * decode_s / token_s)
    tokens = max(MIN_PREFILL_TOKENS, min(MAX_STEP_TOKENS, tokens))
    row_s = max(batch_s - decode_s, 0.0) / max(batch - 1, 1)
    # At most a whole budget: more would only mean "nothing beside a decode but the floors".
    weight = min(max(1.0, row_s / token_s), float(tokens))
    log.info(
        "step token budget %d, a decoding sequence counting %.1f: a decode step %.1f ms "
        "(%d sequences: %.1f ms), a prompt token %.3f ms",
        tokens,
        weight,
        decode_s * 1e3,
        batch,
        batch_s * 1e3,
        token_s * 1e3,
    )
    return MeasuredBudget(tokens, round(weight, 2))


def _prefill(ops: LayerOps, num_tokens: int) -> None:
    vocab = int(ops.decoder.embed_tokens.weight.shape[0])
    plan = PrefillPlan(
        token_ids=tuple(1 + i % (vocab - 1) for i in range(num_tokens)),
        prefix_len=num_tokens,
        prefix_cached=False,
        chunk_spans=(),
        chunk_sources=(),
        recompute_ratio=1.0,
        check_layers=(),
    )
    run_to_end(layer_loop(ops, plan))


def _decode(runner: ModelRunner, position: int, batch: int) -> None:
    """One decode step of `batch` sequences at `position`, each over the pool's first blocks
    (nothing holds them yet: the engine is starting; the rows write the same slot)."""
    table = list(range(position // runner.block_size + 1))
    runner.decode([table] * batch, [position] * batch, [1] * batch)


def _median_s(device: torch.device, run: Callable[[], None]) -> float:
    """Median seconds of `run` over REPEATS runs, the device synchronised around each."""
    samples = []
    for _ in range(REPEATS):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
