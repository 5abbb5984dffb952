"""The real-text quality gate on SmolLM2: teacher-forced KL from full prefill over prompts of
consecutive chunks of shipped documents. r = 1 is full prefill; the engine's default selection
at r = 0.15 beats a random pick of the same budget, full reuse and CacheBlend's own HKVD at check
layer 1, by margins set below the gaps measured (docs/quality.md)."""

from __future__ import annotations

import logging
import statistics

import pytest

from engine.blend.selection import Selection
from engine.engine import Engine
from engine.types import Mode
from evaluation.compare import Case, PromptResult, Variant, compare_prompts
from evaluation.real_text import build_prompts
from tests import real_model

smollm2_dir = real_model.smollm2_dir
log = logging.getLogger(__name__)

# The fixture takes 2.7 min on an idle 2-core machine; on one shared with other jobs it has run
# past the suite's 600 s default.
pytestmark = pytest.mark.timeout(1800)

NUM_PROMPTS = 30
# r = 1 costs a full prefill per prompt; equality to full prefill needs fewer prompts to pin.
R1_PROMPTS = 5
# Shorter chunks than bench/quality_real.py's 128 tokens keep 30 prompts within 3 minutes.
CHUNK_TOKENS = 96
CHUNKS_PER_PROMPT = 4
RATIO = 0.15
# Measured on these 30 prompts (float32, CPU; docs/quality.md "The real-text gate").
R1_MAX_KL = 1e-5  # measured: 0 (below 5e-7 in earlier runs: float32 rounding)
# The default: query_hkvd over check layers 1 and 7; random at the same check layers.
DEFAULT_VS_RANDOM_MARGIN = 0.011  # measured gap 0.023 (random 0.066, default 0.043)
DEFAULT_VS_REUSE_MARGIN = 0.019  # measured gap 0.039 (full reuse 0.082)
DEFAULT_VS_HKVD_MARGIN = 0.002  # measured gap 0.0046 (HKVD at check layer 1: 0.048)


@pytest.fixture(scope="module")
def results(smollm2_dir) -> dict[str, list[float]]:
    """Teacher-forced KL per prompt of each setting, and its argmax agreement ("<label>/agree")."""
    default = Engine.from_pretrained(str(smollm2_dir), dtype="float32", max_num_seqs=1)
    cacheblend = Engine(default.loaded, default.store, check_layers=(1,), max_num_seqs=1)
    exact = [Variant("r=1", default, Mode.CACHEBLEND, 1.0)]
    variants = [
        Variant("full_reuse", default, Mode.FULL_REUSE),
        Variant("default", default, Mode.CACHEBLEND, RATIO),
        Variant("random", default, Mode.CACHEBLEND, RATIO, Selection.RANDOM),
        Variant("hkvd", cacheblend, Mode.CACHEBLEND, RATIO, Selection.HKVD),
    ]
    prompts = build_prompts(
        default.tokenizer,
        chunk_tokens=CHUNK_TOKENS,
        chunks_per_prompt=CHUNKS_PER_PROMPT,
        limit=NUM_PROMPTS,
    )
    assert len(prompts) == NUM_PROMPTS
    cases = [
        Case(p.question, p.passages, exact + variants if i < R1_PROMPTS else variants)
        for i, p in enumerate(prompts)
    ]
    try:
        measured: list[PromptResult] = list(compare_prompts(default, cases))
    finally:
        cacheblend.close()
        default.close()
    out: dict[str, list[float]] = {}
    for variant in exact + variants:
        found = [r.by_label[variant.label] for r in measured if variant.label in r.by_label]
        out[variant.label] = [m.deviation.kl for m in found]
        out[f"{variant.label}/agree"] = [m.deviation.argmax_agreement for m in found]
        # What the margins below are set from (pytest --log-cli-level=INFO shows it).
        log.info(
            "%s: teacher-forced KL mean %.5f max %.5f, argmax agreement %.4f",
            variant.label,
            mean(out[variant.label]),
            max(out[variant.label]),
            mean(out[f"{variant.label}/agree"]),
        )
    return out


def mean(values: list[float]) -> float:
    return statistics.fmean(values)


def test_recomputing_every_token_is_full_prefill(results):
    assert max(results["r=1"]) < R1_MAX_KL
    assert min(results["r=1/agree"]) == 1.0


def test_the_default_selection_deviates_less_than_a_random_pick_of_the_same_budget(results):
    assert mean(results["random"]) - mean(results["default"]) > DEFAULT_VS_RANDOM_MARGIN


def test_the_default_selection_deviates_less_than_full_reuse(results):
    assert mean(results["full_reuse"]) - mean(results["default"]) > DEFAULT_VS_REUSE_MARGIN


def test_the_default_selection_deviates_less_than_cacheblends_hkvd(results):
    assert mean(results["hkvd"]) - mean(results["default"]) > DEFAULT_VS_HKVD_MARGIN
