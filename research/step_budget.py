"""The step token budget's trade-off: the gap between a decoding sequence's tokens against
throughput, for several `max_num_batched_tokens` side by side on one model and one store.

    .venv/bin/python research/step_budget.py                       # 128 256 512, ~5 min on 2 cores
    .venv/bin/python research/step_budget.py --budgets 64 128 --modes cacheblend

Per (mode, budget): a fresh engine (llama-124m shape, bf16, random init) over the same stored
chunks serves `--requests` requests of 6 pooled 512-token chunks + a 32-token question and 32
output tokens, arriving `--gap-s` apart (past what the CPU sustains: prefills overlap the
decodes of earlier requests). Reports the gaps between consecutive output tokens of every
request (p50, p90, max), the same gap for one request alone, each request's mean gap (TPOT)
at p99 against it, tokens/s (output tokens over first arrival to last token) and TTFT p50.
Prints a table and writes bench/results/step_budget[-<tag>]-<device>.csv.
"""

from __future__ import annotations

import os

# A CPU shared with other processes: OpenMP threads that spin at every barrier stall behind
# the other processes' threads; passive waits do not.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import _on_path  # noqa: E402, F401  (bench/ on sys.path)
from harness import (  # noqa: E402
    SHAPES,
    build_model,
    build_store,
    default_dtype,
    store_chunks,
    token_sampler,
    write_rows,
)

from engine.blend.layout import PromptLayout  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.types import GenerateRequest, Mode, TokenDelta  # noqa: E402


@dataclass(frozen=True)
class Row:
    mode: str
    max_num_batched_tokens: int
    requests: int
    gap_s: float
    alone_gap_s: float
    gap_p50_s: float
    gap_p90_s: float
    gap_max_s: float
    gap_p90_vs_alone: float
    tpot_p99_vs_alone: float
    ttft_p50_s: float
    tokens_per_s: float


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=default_dtype())
    parser.add_argument("--shape", default="llama-124m", choices=SHAPES)
    parser.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--tag", help="results file tag")
    modes = [m.value for m in Mode]
    parser.add_argument("--modes", nargs="+", default=["full_prefill", "cacheblend"], choices=modes)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--gap-s", type=float, default=0.5)
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=32)
    args = parser.parse_args()
    if min(args.budgets) < 1 or args.requests < 1 or args.gap_s < 0:
        parser.error("--budgets must be >= 1, --requests >= 1 and --gap-s >= 0")
    return args


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def stream(engine: Engine, request: GenerateRequest, layout: PromptLayout) -> list[float]:
    """The arrival time and then the time of every output token."""
    times = [time.perf_counter()]
    async for event in engine.start(request, layout=layout):
        if isinstance(event, TokenDelta) and event.token_id is not None:
            times.append(time.perf_counter())
    return times


async def arrivals(engine: Engine, request, layouts, gap_s: float) -> list[list[float]]:
    tasks = []
    for layout in layouts:
        tasks.append(asyncio.create_task(stream(engine, request, layout)))
        await asyncio.sleep(gap_s)
    return list(await asyncio.gather(*tasks))


def gaps(times: list[float]) -> list[float]:
    tokens = times[1:]
    return [b - a for a, b in zip(tokens, tokens[1:], strict=False)]


def measure(engine: Engine, mode: Mode, budget: int, layouts, args) -> Row:
    ratio = 0.15 if mode is Mode.CACHEBLEND else None
    request = GenerateRequest(
        question="q",
        chunks=(),
        mode=mode,
        recompute_ratio=ratio,
        max_tokens=args.output_tokens,
        ignore_eos=True,
    )
    asyncio.run(stream(engine, request, layouts[0]))  # warm-up
    alone = statistics.median(gaps(asyncio.run(stream(engine, request, layouts[0]))))
    runs = asyncio.run(arrivals(engine, request, layouts[1:], args.gap_s))
    every_gap = [g for times in runs for g in gaps(times)]
    first_arrival = min(times[0] for times in runs)
    last_token = max(times[-1] for times in runs)
    p90 = quantile(every_gap, 0.9)
    tpots = [statistics.mean(gaps(times)) for times in runs]
    return Row(
        mode=mode.value,
        max_num_batched_tokens=budget,
        requests=len(runs),
        gap_s=args.gap_s,
        alone_gap_s=alone,
        gap_p50_s=quantile(every_gap, 0.5),
        gap_p90_s=p90,
        gap_max_s=max(every_gap),
        gap_p90_vs_alone=p90 / alone,
        tpot_p99_vs_alone=quantile(tpots, 0.99) / alone,
        ttft_p50_s=statistics.median(times[1] - times[0] for times in runs),
        tokens_per_s=sum(len(times) - 1 for times in runs) / (last_token - first_arrival),
    )


def run_config(loaded, store, mode: Mode, budget: int, args) -> Row:
    """One fresh engine over the store: the same requests and arrivals as every other."""
    engine = Engine(
        loaded,
        store,
        max_num_seqs=16,
        max_model_len=4096,
        max_num_batched_tokens=budget,
    )
    try:
        tokens = token_sampler(engine, seed=1)
        pool = [tokens(args.chunk_tokens) for _ in range(4 * args.chunks)]
        prefix = engine.prompts.build("q", []).prefix
        store_chunks(engine, PromptLayout(prefix, tuple(pool), ()))
        rng = random.Random(2)
        layouts = [
            PromptLayout(prefix, tuple(rng.sample(pool, args.chunks)), tokens(32))
            for _ in range(args.requests + 1)
        ]
        row = measure(engine, mode, budget, layouts, args)
    finally:
        engine.close()
    print(
        f"{row.mode:12s} budget {budget:5d}: gap p50 {row.gap_p50_s * 1e3:6.1f} "
        f"ms p90 {row.gap_p90_s * 1e3:6.1f} ms ({row.gap_p90_vs_alone:.2f}x alone "
        f"{row.alone_gap_s * 1e3:.1f} ms), max {row.gap_max_s * 1e3:.0f} ms, TPOT p99 "
        f"{row.tpot_p99_vs_alone:.2f}x alone, TTFT p50 {row.ttft_p50_s:.2f} s, "
        f"{row.tokens_per_s:.1f} tok/s",
        flush=True,
    )
    return row


def main() -> None:
    args = parse_args()
    loaded = build_model(args.shape, args.device, args.dtype)
    store = build_store(loaded)
    rows: list[Row] = []
    for mode in [Mode(m) for m in args.modes]:
        for budget in args.budgets:
            rows.append(run_config(loaded, store, mode, budget, args))
    write_rows(f"step_budget-{args.tag + '-' if args.tag else ''}{args.device}.csv", rows)


if __name__ == "__main__":
    main()
