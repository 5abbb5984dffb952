"""The requests of bench/serving.py's serving part: pooled precomputed chunks, each request's
prompt (a fixed chunk count or a seeded mix of counts) and the Poisson arrival gaps."""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass

from harness import store_chunks, token_sampler

from engine.blend.layout import PromptLayout
from engine.engine import Engine
from engine.types import GenerateRequest, Mode

MODES = (Mode.FULL_PREFILL, Mode.CACHEBLEND)


@dataclass
class Workload:
    """Per request index, its layout and arrival gap: the same sequence of requests (and gaps)
    at every point, so the configurations see identical load. `unloaded` holds the layouts of
    the unloaded measurement, the first of them a warm-up."""

    layouts: list[PromptLayout]
    gaps: list[float]  # inter-arrival times of a Poisson process of rate 1
    unloaded: list[PromptLayout]

    def arrivals(self, rate: float, count: int) -> list[float]:
        times, now = [], 0.0
        for gap in self.gaps[:count]:
            now += gap / rate
            times.append(now)
        return times

    def describe(self, args: argparse.Namespace) -> str:
        sent = [layout.num_tokens for layout in self.layouts[: args.requests]]
        if not args.prompt_chunks:
            return (
                f"prompt {sent[0]} tokens ({args.chunks} of {args.pool_chunks} pooled chunks x "
                f"{args.chunk_tokens} + {args.question_tokens}-token question)"
            )
        counts = " ".join(str(c) for c in args.prompt_chunks)
        return (
            f"prompt mix: each request draws its chunk count from [{counts}] (seeded) of "
            f"{args.pool_chunks} pooled chunks x {args.chunk_tokens} + {args.question_tokens}-"
            f"token question: the first {len(sent)} prompts {min(sent)}..{max(sent)} tokens, "
            f"median {statistics.median(sent):.0f}; the unloaded TTFT and TPOT are medians over "
            f"one request per distinct count"
        )


def build_workload(engine: Engine, args: argparse.Namespace, count: int) -> Workload:
    tokens = token_sampler(engine, seed=1)
    pool = [tokens(args.chunk_tokens) for _ in range(args.pool_chunks)]
    prefix = engine.prompts.build("q", []).prefix
    store_chunks(engine, PromptLayout(prefix, tuple(pool), ()))
    rng = random.Random(2)
    # The counts come from a generator of their own: without --prompt-chunks the chunks,
    # questions and gaps drawn are those of earlier runs, so their numbers stay comparable.
    mix = random.Random(3)
    counts = [
        mix.choice(args.prompt_chunks) if args.prompt_chunks else args.chunks for _ in range(count)
    ]
    layouts = [
        PromptLayout(prefix, tuple(rng.sample(pool, c)), tokens(args.question_tokens))
        for c in counts
    ]
    gaps = [rng.expovariate(1.0) for _ in range(count)]
    if args.prompt_chunks:
        # One request per count: their median is the median count's, as the loaded p50 is.
        unloaded = [layouts[-1]] + [
            PromptLayout(prefix, tuple(rng.sample(pool, c)), tokens(args.question_tokens))
            for c in sorted(set(args.prompt_chunks))
        ]
    else:
        unloaded = [layouts[-1 - i] for i in range(args.unloaded_requests + 1)]
    return Workload(layouts, gaps, unloaded)


def request_for(mode: Mode, args: argparse.Namespace) -> GenerateRequest:
    return GenerateRequest(
        question="benchmark",
        mode=mode,
        recompute_ratio=args.ratio if mode is Mode.CACHEBLEND else None,
        max_tokens=args.output_tokens,
        ignore_eos=True,
    )
