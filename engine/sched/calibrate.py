"""The step token budget from this machine's speeds, measured once when the engine starts: as
many prompt tokens per step as cost PREFILL_DECODE_STEPS decode steps of one sequence, so that a
decoding sequence's time per token under load stays a small multiple of its time alone."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import torch

from engine.blend.dense import run_to_end
from engine.blend.loop import layer_loop
from engine.blend.plan import PrefillPlan
from engine.model.layers import LayerOps
from engine.runner.model_runner import ModelRunner
from engine.sched.scheduler import MIN_PREFILL_TOKENS

log = logging.getLogger(__name__)

# A step's prefill work costs at most this many lone decode steps: with its decode, a step takes
# ~2.5 of them, inside the 3x a decoding sequence may take under load (the overload target).
PREFILL_DECODE_STEPS = 1.5
# The most tokens a step feeds the model: past it a GPU's step costs more than its decodes'
# time for little more prefill throughput (docs/benchmarks/serving.md, "The step budget").
MAX_STEP_TOKENS = 2048
# The prompts timed: their difference is the cost of a prompt token, without the fixed costs
# of a forward (which the decode of the same step pays already).
SHORT_PROMPT, LONG_PROMPT = 64, 256
REPEATS = 2


def step_token_budget(ops: LayerOps, runner: ModelRunner) -> int:
    """Prompt tokens per step: PREFILL_DECODE_STEPS x (one decode step / one prompt token),
    each timed on this machine (the device synchronised around each run; medians of REPEATS),
    within [MIN_PREFILL_TOKENS, MAX_STEP_TOKENS]."""
    long = min(LONG_PROMPT, runner.max_model_len - 1)
    short = min(SHORT_PROMPT, long // 2)
    if short < 1:
        return MIN_PREFILL_TOKENS
    with torch.inference_mode():
        _prefill(ops, short)  # warm: allocator, kernels, RoPE tables
        _decode(runner, long)
        short_s = _median_s(ops.device, lambda: _prefill(ops, short))
        long_s = _median_s(ops.device, lambda: _prefill(ops, long))
        decode_s = _median_s(ops.device, lambda: _decode(runner, long))
    token_s = max(long_s - short_s, 1e-9) / (long - short)
    budget = int(PREFILL_DECODE_STEPS * decode_s / token_s)
    budget = max(MIN_PREFILL_TOKENS, min(MAX_STEP_TOKENS, budget))
    log.info(
        "step token budget %d: a decode step %.1f ms, a prompt token %.3f ms",
        budget,
        decode_s * 1e3,
        token_s * 1e3,
    )
    return budget


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


def _decode(runner: ModelRunner, position: int) -> None:
    """One decode step of one sequence at `position`, over the pool's first blocks (nothing
    holds them yet: the engine is starting)."""
    table = list(range(position // runner.block_size + 1))
    runner.decode([table], [position], [1])


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
