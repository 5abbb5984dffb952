"""One load point of bench/serving.py: Poisson arrivals to one engine, each request's TTFT and
TPOT, and the point's percentiles, throughput and counts (completed, refused, unfinished)."""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from dataclasses import dataclass, field

from serving_workload import Workload, request_for

from engine.blend.layout import PromptLayout
from engine.engine import Engine
from engine.errors import QueueFullError
from engine.types import GenerateRequest, GenerateResult, LayerTimes, Mode, StepRecord, TokenDelta

# Added to the drain cap: a healthy engine answers within it even on a busy shared CPU.
DRAIN_MARGIN_S = 10.0


@dataclass
class Outcome:
    arrival_s: float
    first_token_s: float | None = None
    last_token_s: float | None = None
    tokens: int = 0  # streamed so far
    gaps_s: list[float] = field(default_factory=list)  # between consecutive tokens
    result: GenerateResult | None = None
    refused: bool = False
    error: str | None = None
    end_s: float = math.inf  # when the point stopped waiting for it

    def tpot_s(self) -> float | None:
        """Seconds per output token after the first. Unanswered: the time from its first token
        to the point's end per token after the first (at least one), the pace it had reached."""
        if self.first_token_s is None or self.last_token_s is None:
            return None
        if self.result is None:
            return (self.end_s - self.first_token_s) / max(self.tokens - 1, 1)
        if self.tokens < 2:
            return None
        return (self.last_token_s - self.first_token_s) / (self.tokens - 1)


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
    # Fields after `sustained` came later: older CSVs lack them and load with these defaults.
    tpot_p50_s: float = math.nan
    tpot_p99_s: float = math.nan
    drain_s: float = math.nan  # from the last arrival until every admitted answer (or the cap)
    overload_factor: float = math.nan  # x the sustained rate; nan: a rate-fraction point
    # The median TPOT of requests alone just before and after the point (nan: an older CSV).
    unloaded_tpot_s: float = math.nan
    # The gaps between consecutive tokens of every request: slack trades single long gaps for
    # TTFT while each request's mean (TPOT) holds.
    gap_p90_s: float = math.nan
    gap_max_s: float = math.nan
    # 0: the sweep's point; 1, 2, ...: a rerun of it for the overload target's throughput
    # criterion (bench/serving_overload.py), left out of the tables and the plot.
    rerun: int = 0
    ttft_samples: list[float] = field(default_factory=list, repr=False)


@dataclass(frozen=True)
class Unloaded:
    ttft_s: float
    request_s: float
    tpot_s: float
    # Medians of the engine's own split of a request alone: queued, prefilling (of which
    # waiting on chunk KV and computing layers), what the first token's TTFT leaves over.
    queue_s: float = math.nan
    prefill_s: float = math.nan
    kv_wait_s: float = math.nan
    recompute_s: float = math.nan
    # The layer timeline (engine.types.LayerTimes) of the request of median TTFT.
    layers: list[LayerTimes] = field(default_factory=list)

    def split(self) -> str:
        return (
            f"queue {self.queue_s:.3f} s, prefill {self.prefill_s:.3f} s (KV wait "
            f"{self.kv_wait_s:.3f} s, layers computing {self.recompute_s:.3f} s), rest "
            f"{self.ttft_s - self.queue_s - self.prefill_s:.3f} s"
        )


@dataclass
class Config:
    """One (mode, scheduler) engine, its unloaded figures, and its decode batch sizes."""

    engine: Engine
    mode: Mode
    scheduler: str
    max_num_seqs: int
    unloaded: Unloaded
    decode_batches: list[int] = field(default_factory=list)

    def record_step(self, record: StepRecord) -> None:
        if record.num_decodes:
            self.decode_batches.append(record.num_decodes)


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
            if isinstance(event, TokenDelta) and event.token_id is not None:
                now = time.perf_counter()
                if outcome.last_token_s is not None:
                    outcome.gaps_s.append(now - outcome.last_token_s)
                outcome.last_token_s = now
                if outcome.first_token_s is None:
                    outcome.first_token_s = outcome.last_token_s
                outcome.tokens += 1
            elif isinstance(event, GenerateResult):
                outcome.result = event
    except asyncio.CancelledError:
        generation.cancel()
        raise
    except Exception as exc:  # noqa: BLE001 - a benchmark counts failures, it does not stop
        outcome.error = f"{type(exc).__name__}: {exc}"


def drain_cap_s(args: argparse.Namespace, outstanding: int, unloaded: Unloaded) -> float:
    """`--drain-s`, else twice the time one at a time would take for the outstanding requests
    (plus a margin): the target is that every admitted request completes, so the point waits
    for a healthy engine to answer them all, and only a stuck one hits the cap."""
    if args.drain_s is not None:
        return args.drain_s
    return DRAIN_MARGIN_S + 2 * outstanding * unloaded.request_s


async def run_point(
    config: Config, workload: Workload, args: argparse.Namespace, rate: float
) -> tuple[list[Outcome], float, float]:
    """Send Poisson arrivals until the request count or the time limit, then wait until every
    admitted request has answered (at most the drain cap); cancel what is left. Returns the
    outcomes, the elapsed seconds and the seconds of the drain."""
    engine = config.engine
    request = request_for(config.mode, args)
    arrivals = [t for t in workload.arrivals(rate, args.requests) if t <= args.time_limit_s]
    outcomes: list[Outcome] = []
    tasks: list[asyncio.Task] = []
    config.decode_batches.clear()
    start = time.perf_counter()
    for index, at in enumerate(arrivals):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        outcome = Outcome(arrival_s=time.perf_counter())
        outcomes.append(outcome)
        layout = workload.layouts[index]
        tasks.append(asyncio.create_task(one_request(engine, request, layout, outcome)))
    arrived = time.perf_counter()
    if tasks:
        outstanding = sum(not t.done() for t in tasks)
        cap = drain_cap_s(args, outstanding, config.unloaded)
        _, pending = await asyncio.wait(tasks, timeout=cap)
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
    return outcomes, end - start, end - arrived


def summarise(point: Point, outcomes: list[Outcome], elapsed_s: float, unloaded_s: float) -> None:
    ttfts, queues, tpots, gaps, tokens = [], [], [], [], 0
    for o in outcomes:
        if o.refused:
            point.refused += 1
            continue
        if o.error is not None:
            point.errors += 1
            continue
        gaps += o.gaps_s
        if (tpot := o.tpot_s()) is not None:
            tpots.append(tpot)
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
    point.tpot_p50_s = percentile(tpots, 50)
    point.tpot_p99_s = percentile(tpots, 99)
    point.queue_p50_s = percentile(queues, 50)
    point.gap_p90_s = percentile(gaps, 90)
    point.gap_max_s = max(gaps, default=math.nan)
    point.elapsed_s = elapsed_s
    point.tokens_per_s = tokens / elapsed_s if elapsed_s else 0.0
    point.requests_per_s = point.completed / elapsed_s if elapsed_s else 0.0
    point.sustained = point.ttft_p50_s <= 2 * unloaded_s and point.refused == 0
