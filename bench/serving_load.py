"""Part 1 of bench/serving.py: TTFT of the engine under Poisson load, per mode and scheduler,
and the highest request rate each sustains with TTFT p50 <= 2x its unloaded TTFT."""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import random
import statistics
import time
from dataclasses import dataclass, field

from harness import store_chunks, token_sampler

from engine.engine import Engine
from engine.errors import QueueFullError
from engine.prompt import PromptLayout
from engine.types import GenerateRequest, GenerateResult, Mode, TokenDelta

MODES = (Mode.FULL_PREFILL, Mode.CACHEBLEND)


# -- workload --------------------------------------------------------------------------------


@dataclass
class Workload:
    """A pool of precomputed chunks and, per request index, its layout: the same sequence of
    requests (and arrival gaps) at every point, so the configurations see identical load."""

    layouts: list[PromptLayout]
    gaps: list[float]  # inter-arrival times of a Poisson process of rate 1

    def arrivals(self, rate: float, count: int) -> list[float]:
        times, now = [], 0.0
        for gap in self.gaps[:count]:
            now += gap / rate
            times.append(now)
        return times


def build_workload(engine: Engine, args: argparse.Namespace, count: int) -> Workload:
    tokens = token_sampler(engine, seed=1)
    pool = [tokens(args.chunk_tokens) for _ in range(args.pool_chunks)]
    prefix = engine.prompts.build("q", []).prefix
    store_chunks(engine, PromptLayout(prefix, tuple(pool), ()))
    rng = random.Random(2)
    layouts = [
        PromptLayout(
            prefix,
            tuple(rng.sample(pool, args.chunks)),
            tokens(args.question_tokens),
        )
        for _ in range(count)
    ]
    gaps = [rng.expovariate(1.0) for _ in range(count)]
    return Workload(layouts, gaps)


def request_for(mode: Mode, args: argparse.Namespace) -> GenerateRequest:
    return GenerateRequest(
        question="benchmark",
        mode=mode,
        recompute_ratio=args.ratio if mode is Mode.CACHEBLEND else None,
        max_tokens=args.output_tokens,
        ignore_eos=True,
    )


# -- serving under Poisson load ------------------------------------------------------------


@dataclass
class Outcome:
    arrival_s: float
    first_token_s: float | None = None
    result: GenerateResult | None = None
    refused: bool = False
    error: str | None = None
    end_s: float = math.inf  # when the point stopped waiting for it


@dataclass
class Point:
    mode: str
    scheduler: str
    max_num_seqs: int
    rate_fraction: float
    rate: float
    sent: int = 0
    completed: int = 0
    refused: int = 0
    unfinished: int = 0
    errors: int = 0
    ttft_p50_s: float = math.nan
    ttft_p99_s: float = math.nan
    queue_p50_s: float = math.nan
    tokens_per_s: float = 0.0
    requests_per_s: float = 0.0
    mean_decode_batch: float = math.nan
    elapsed_s: float = 0.0
    sustained: bool = False
    ttft_samples: list[float] = field(default_factory=list, repr=False)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    low = math.floor(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


async def one_request(
    engine: Engine, request: GenerateRequest, layout: PromptLayout, outcome: Outcome
) -> None:
    try:
        generation = engine.start(request, layout=layout)
    except QueueFullError:
        outcome.refused = True
        return
    try:
        async for event in generation:
            if isinstance(event, TokenDelta) and outcome.first_token_s is None:
                outcome.first_token_s = time.perf_counter()
            elif isinstance(event, GenerateResult):
                outcome.result = event
    except asyncio.CancelledError:
        generation.cancel()
        raise
    except Exception as exc:  # noqa: BLE001 - a benchmark counts failures, it does not stop
        outcome.error = f"{type(exc).__name__}: {exc}"


async def run_point(
    engine: Engine,
    workload: Workload,
    mode: Mode,
    args: argparse.Namespace,
    rate: float,
    decode_batches: list[int],
) -> tuple[list[Outcome], float]:
    """Send Poisson arrivals until the request count or the time limit, then wait up to the
    drain limit for the answers; cancel what is left. Returns outcomes and elapsed seconds."""
    request = request_for(mode, args)
    arrivals = [t for t in workload.arrivals(rate, args.requests) if t <= args.time_limit_s]
    outcomes: list[Outcome] = []
    tasks: list[asyncio.Task] = []
    decode_batches.clear()
    start = time.perf_counter()
    for index, at in enumerate(arrivals):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        outcome = Outcome(arrival_s=time.perf_counter())
        outcomes.append(outcome)
        layout = workload.layouts[index]
        tasks.append(asyncio.create_task(one_request(engine, request, layout, outcome)))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=args.drain_s)
        end = time.perf_counter()
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    else:
        end = time.perf_counter()
    # Cancelled sequences leave at the engine's next step: wait for it to be idle.
    while engine.num_running or engine.num_waiting:
        await asyncio.sleep(0.01)
    for outcome in outcomes:
        outcome.end_s = end
    return outcomes, end - start


def summarise(point: Point, outcomes: list[Outcome], elapsed_s: float, unloaded_s: float) -> None:
    ttfts, queues, tokens = [], [], 0
    for o in outcomes:
        if o.refused:
            point.refused += 1
            continue
        if o.error is not None:
            point.errors += 1
            continue
        if o.result is not None:
            point.completed += 1
            ttfts.append(o.result.timings.ttft_s)
            queues.append(o.result.timings.queue_s)
            tokens += o.result.usage.completion_tokens
            continue
        point.unfinished += 1
        # Unanswered at the end of the point: the TTFT it reached is a lower bound.
        seen = o.first_token_s if o.first_token_s is not None else o.end_s
        ttfts.append(seen - o.arrival_s)
    point.sent = len(outcomes)
    point.ttft_samples = ttfts
    point.ttft_p50_s = percentile(ttfts, 50)
    point.ttft_p99_s = percentile(ttfts, 99)
    point.queue_p50_s = percentile(queues, 50)
    point.elapsed_s = elapsed_s
    point.tokens_per_s = tokens / elapsed_s if elapsed_s else 0.0
    point.requests_per_s = point.completed / elapsed_s if elapsed_s else 0.0
    point.sustained = point.ttft_p50_s <= 2 * unloaded_s and point.refused == 0


def measure_unloaded(
    engine: Engine, workload: Workload, mode: Mode, args: argparse.Namespace
) -> tuple[float, float]:
    """Median TTFT and total time of requests sent one at a time (after one warm-up)."""
    request = request_for(mode, args)
    ttfts, totals = [], []
    for index in range(args.unloaded_requests + 1):
        result = engine.generate(request, layout=workload.layouts[-1 - index])
        if index:
            ttfts.append(result.timings.ttft_s)
            totals.append(result.timings.total_s)
    return statistics.median(ttfts), statistics.median(totals)


def sustained_rate(points: list[Point], unloaded_s: float) -> tuple[float, str]:
    """The highest rate with TTFT p50 <= 2x unloaded, interpolated linearly (in rate) between
    the last passing point and the first failing one; '>=' when every point passes."""
    points = sorted(points, key=lambda p: p.rate)
    limit = 2 * unloaded_s
    last = None
    for p in points:
        if not p.sustained:
            if last is None:
                return points[0].rate, "<"
            if p.ttft_p50_s <= limit:  # failed on refusals only
                return last.rate, "="
            span = (limit - last.ttft_p50_s) / (p.ttft_p50_s - last.ttft_p50_s)
            return last.rate + span * (p.rate - last.rate), "~"
        last = p
    return points[-1].rate, ">="


def serving(
    loaded, store, args: argparse.Namespace, notes: list[str]
) -> tuple[list[Point], list[dict]]:
    schedulers = [("batching", args.max_num_seqs), ("one-at-a-time", 1)]
    schedulers = [s for s in schedulers if s[0] in args.schedulers]
    points: list[Point] = []
    summary: list[dict] = []
    unloaded: dict[Mode, tuple[float, float]] = {}
    workload = None
    decode_batches: list[int] = []
    for scheduler, max_num_seqs in schedulers:
        for mode in [m for m in MODES if m.value in args.modes]:
            engine = Engine(
                loaded,
                store,
                max_num_seqs=max_num_seqs,
                max_model_len=args.serving_model_len,
                max_waiting=args.max_waiting,
            )
            engine.add_step_listener(
                lambda r: decode_batches.append(r.num_seqs) if not r.is_prefill else None
            )
            try:
                if workload is None:
                    workload = build_workload(engine, args, args.requests + 32)
                    notes.append(
                        f"prompt {workload.layouts[0].num_tokens} tokens ({args.chunks} of "
                        f"{args.pool_chunks} pooled chunks x {args.chunk_tokens} + "
                        f"{args.question_tokens}-token question), {args.output_tokens} output "
                        f"tokens; KV slots {engine.runner.num_slots} x {engine.max_model_len}"
                    )
                if mode not in unloaded:
                    unloaded[mode] = measure_unloaded(engine, workload, mode, args)
                    ttft, total = unloaded[mode]
                    print(f"unloaded {mode.value}: TTFT {ttft:.3f} s, request {total:.3f} s")
                else:
                    engine.generate(request_for(mode, args), layout=workload.layouts[-1])
                unloaded_ttft = unloaded[mode][0]
                config_points = []
                for fraction in args.rate_fractions:
                    rate = fraction / unloaded_ttft
                    point = Point(mode.value, scheduler, max_num_seqs, fraction, rate)
                    outcomes, elapsed = asyncio.run(
                        run_point(engine, workload, mode, args, rate, decode_batches)
                    )
                    summarise(point, outcomes, elapsed, unloaded_ttft)
                    if decode_batches:
                        point.mean_decode_batch = statistics.mean(decode_batches)
                    config_points.append(point)
                    print(
                        f"  {mode.value:<13}{scheduler:<14}{rate:7.3f}/s  sent {point.sent:3d} "
                        f"done {point.completed:3d} refused {point.refused:2d} "
                        f"TTFT p50 {point.ttft_p50_s:7.3f} p99 {point.ttft_p99_s:7.3f}  "
                        f"{point.tokens_per_s:6.1f} tok/s  {elapsed:5.1f} s",
                        flush=True,
                    )
                points += config_points
                rate, how = sustained_rate(config_points, unloaded_ttft)
                summary.append(
                    {
                        "mode": mode.value,
                        "scheduler": scheduler,
                        "max_num_seqs": max_num_seqs,
                        "unloaded_ttft_s": unloaded_ttft,
                        "unloaded_request_s": unloaded[mode][1],
                        "sustained_rate": rate,
                        "sustained_how": how,
                    }
                )
            finally:
                engine.close()
                del engine
                gc.collect()
    return points, summary
